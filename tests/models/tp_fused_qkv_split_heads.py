"""Issue 57: one fused q, k, v projection viewed as heads and split by head counts, its key/value heads tiled to the
query heads, as ring-attention-pytorch writes its grouped-query attention (``ring_attention.py``:
``rearrange(to_qkv(x), 'b n (h d) -> b n h d').split((heads, kv_heads, kv_heads), dim=-2)``, then in
``default_attention`` ``repeat(t, '... h d -> ... (g h) d')`` of k and v: query head i reads key/value head i mod
kv_heads, and ``einsum('b i h d, b j h d -> b h i j')``); 4 query heads and 2 key/value heads of 16, hidden 64,
2 layers, 16 tokens.

Under ``--tp 2`` the passes over the stages learned the projection's segments as 64 | 32 | 32 (the split's cuts),
then as 64 | 64, then 64 | 32 | 32 again, without end: the planner never returned (``tp_learn._learn_segments``
now keeps every point it has learned).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

KV = 2


class SplitHeadsAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(D, (HEADS + 2 * KV) * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.to_qkv(x).view(B, T, HEADS + 2 * KV, HEAD_DIM).split((HEADS, KV, KV), dim=-2)
        groups = HEADS // KV
        k, v = (t.unsqueeze(-3).expand(B, T, groups, KV, HEAD_DIM).reshape(B, T, HEADS, HEAD_DIM)  # '(g h)'
                for t in (k, v))
        sim = torch.einsum("b i h d, b j h d -> b h i j", q * HEAD_DIM ** -0.5, k)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b j h d -> b i h d", attn, v)
        return self.to_out(out.reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), SplitHeadsAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
