"""Issue 57: litgpt's LLaMA-Adapter (``litgpt/adapter.py``, ``CausalSelfAttention.scaled_dot_product_attention``): a
learned prompt of a few tokens (``adapter_wte``) made into keys and values by the layer's own projections, attended
by every query through a second attention with an all-ones mask ``[T, prompt]``, its output gated per head
(``gating_factor``) and added to the causal attention's; lit-gpt's decoder otherwise, hidden 64, 4 heads, 16 tokens,
2 layers.

``--cp 2`` refused the prompt's attention ("mixes the positions of the sequence"): its keys have no positions, so
each rank's queries read all of them and nothing crosses ranks.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import (D, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, SwiGLU, apply_rope, loss_fn,  # noqa: F401
                       sgd, token_batch)

PROMPT = 4


class AdapterAttention(SeparateAttention):
    def __init__(self):
        super().__init__(HEADS)
        self.adapter_wte = nn.Embedding(PROMPT, D)
        self.gating_factor = nn.Parameter(0.1 * torch.randn(1, HEADS, 1, 1))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        v = self.to_v(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        prefix = self.adapter_wte.weight.reshape(1, PROMPT, D)
        ak = self.to_k(prefix).view(1, PROMPT, HEADS, HEAD_DIM).transpose(1, 2).expand(B, -1, -1, -1)
        av = self.to_v(prefix).view(1, PROMPT, HEADS, HEAD_DIM).transpose(1, 2).expand(B, -1, -1, -1)
        amask = torch.ones(T, PROMPT, dtype=torch.bool, device=x.device)
        y = y + self.gating_factor * F.scaled_dot_product_attention(q, ak, av, attn_mask=amask)
        return self.to_out(y.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), AdapterAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
