"""Issue 57: x-transformers' attention with a learned sink per head and sparse top-k scores (``attend.py``:
``attn_head_learned_sink``: ``cat((repeat(head_attn_sink, 'h -> b h i 1'), sim), dim=-1)``; ``attn_sparse_topk``:
``sparse_topk_attn``, the scores below each row's k-th largest masked before the softmax), its key/value heads tiled
to the query heads with ``repeat`` (2 key/value heads for 4 query heads: rank r holds query heads r and r + 2, the
scores in two segments); lit-gpt's decoder otherwise, hidden 64, 16 tokens, 2 layers.

``--tp 2`` kept the queries and keys whole (0.62 of each layer sharded): the cat of the whole sink and the scores
in segments was refused (the sink's segments counted as None), and top-k's values, placed as its outputs, were
never read as shards (a getitem of a multi-output op found no sharded input).
"""
import functools

import torch
import torch.nn as nn
from lib_style import (D, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, SwiGLU, apply_rope, loss_fn,  # noqa: F401
                       sgd, token_batch)

TOPK = 4


class SinkTopkAttention(SeparateAttention):
    def __init__(self):
        super().__init__(2)
        self.head_attn_sink = nn.Parameter(0.1 * torch.randn(HEADS))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.to_v(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        r = HEADS // self.kv_heads
        k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5
        mask_value = -torch.finfo(sim.dtype).max
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        sim = sim.masked_fill(causal, mask_value)
        sink = self.head_attn_sink[None, :, None, None].expand(B, HEADS, T, 1)
        sim = torch.cat((sink, sim), dim=-1)
        top_values, _ = sim.topk(TOPK, dim=-1)
        keep = (sim >= top_values.select(-1, -1).unsqueeze(-1)) & (sim > mask_value)
        attn = sim.masked_fill(~keep, mask_value).softmax(dim=-1)[..., 1:]
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), SinkTopkAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
