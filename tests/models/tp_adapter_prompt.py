"""litgpt's LLaMA-Adapter (``litgpt/adapter.py``, ``CausalSelfAttention``, litgpt 0.5.13) on its fused attention:
each layer's ``qkv`` projection is laid out in parts (all query heads, then the keys, then the values: 2 key/value
groups of 2 query heads) and split apart for the attention, and the same ``qkv`` also runs on the layer's learned
prompt (``adapter_wte``, 4 tokens), whose product the adapter views in the grouped layout (``[1, aT, groups,
heads_per_group + 2, head_dim]``, as lit-gpt before 0.5 laid out its weight) for the prompt's keys and values; the
queries attend to them with a mask of ones, scaled by a per-head ``gating_factor`` and added to the attention's output.

The one weight is read in two layouts. The plan must keep ``qkv`` column-wise by parts (it was made whole: the
prompt's product, needed whole by the grouped view, made the weight whole in every use, and the attention with it,
0.66 of each layer sharded) and gather the prompt's product alone, each part's pieces in the parts' order.
"""
import functools

import torch
import torch.nn as nn
from lib_style import (D, HEAD_DIM, HEADS, Decoder, GroupedFusedAttention, RMSNorm, SwiGLU, apply_rope, loss_fn, sgd,
                       token_batch)

KV_HEADS = 2
PROMPT = 4  # adapter_prompt_length


class AdapterAttention(GroupedFusedAttention):
    def __init__(self, groups):
        super().__init__(groups, layout="parts")
        self.adapter_wte = nn.Embedding(PROMPT, D)
        self.gating_factor = nn.Parameter(torch.full((1, HEADS, 1, 1), 0.5))

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        y, q = self.attend(x, cos, sin)  # (B, nh_q, T, hs), before the output projection
        prefix = self.adapter_wte.weight.reshape(1, PROMPT, D)
        aqkv = self.attn(prefix)
        q_per_kv = HEADS // self.groups
        aqkv = aqkv.view(1, PROMPT, self.groups, q_per_kv + 2, HEAD_DIM)
        aqkv = aqkv.permute(0, 2, 3, 1, 4)
        _, ak, av = aqkv.split((q_per_kv, 1, 1), dim=2)
        ak = ak.repeat_interleave(q_per_kv, dim=2).view(1, -1, PROMPT, HEAD_DIM)
        av = av.repeat_interleave(q_per_kv, dim=2).view(1, -1, PROMPT, HEAD_DIM)
        amask = torch.ones(T, PROMPT, dtype=torch.bool)
        ay = torch.nn.functional.scaled_dot_product_attention(q, ak, av, attn_mask=amask,
                                                              scale=HEAD_DIM ** -0.5)
        y = y + self.gating_factor * ay
        return self.proj(y.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))

    def attend(self, x, cos, sin):
        """The parts layout of :class:`GroupedFusedAttention`, with its queries, which attend to the prompt too."""
        B, T, C = x.size()
        q, k, v = self.attn(x).split((HEADS * HEAD_DIM, self.groups * HEAD_DIM, self.groups * HEAD_DIM), dim=-1)
        q = q.view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.view(B, T, self.groups, HEAD_DIM).transpose(1, 2)
        v = v.view(B, T, self.groups, HEAD_DIM).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q_per_kv = HEADS // self.groups
        k, v = k.repeat_interleave(q_per_kv, dim=1), v.repeat_interleave(q_per_kv, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HEAD_DIM ** -0.5), q


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(AdapterAttention, KV_HEADS), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
