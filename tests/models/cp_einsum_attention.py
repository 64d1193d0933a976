"""Attention spelled as ``einsum`` under ``--cp``, as two libraries outside transformers write it: x-transformers'
default path (``attend.py``: ``b h i d, b h j d -> b h i j``, a causal mask, softmax, ``b h i j, b h j d -> b h i d``
on key/value heads tiled to the query heads; ``lib_style.SeparateAttention``) in the first layer, and PaLM's
multi-query attention (``palm_pytorch.py``: one key/value head shared by every query head, ``b h i d, b j d ->
b h i j`` and ``b h i j, b j d -> b h i d``) in the second; RMSNorm, a SwiGLU MLP, 16 tokens. The loss casts the
logits with ``.float()`` as many training scripts do (the loss is traced on meta tensors, which leaves a check of
the meta device in its graph).

``--cp 2`` must place both attentions as it places ``q @ k.T``: the keys and values gathered over the sequence, the
causal mask cut to this rank's query rows (it refused every einsum before); and verify the loss (before, a cast in
the loss left it "not verified": the device check ran against the meta device).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import (D, HEAD_DIM, HEADS, VOCAB, Decoder, RMSNorm, SeparateAttention, SwiGLU, apply_rope, sgd,
                       token_batch)


class MultiQueryEinsumAttention(nn.Module):
    """PaLM's attention: queries per head, one key and one value for all heads."""

    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.to_kv = nn.Linear(D, 2 * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.to_kv(x).split(HEAD_DIM, dim=-1)
        q = apply_rope(q, cos, sin) * HEAD_DIM ** -0.5
        k = apply_rope(k.unsqueeze(1), cos, sin).squeeze(1)
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    kinds = iter([lambda: SeparateAttention(2), MultiQueryEinsumAttention])
    return Decoder(2, lambda: RMSNorm(D), lambda: next(kinds)(), SwiGLU)


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
