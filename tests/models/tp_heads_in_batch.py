"""Issue 57: heads merged into the batch before a linear over each head's features, as long-short-transformer
writes its attention (``long_short_transformer.py``: ``rearrange(t, 'b n (h d) -> (b h) n d')`` of q, k and v, then
``to_dynamic_proj``, a ``Linear(dim_head, r)`` of each head's keys); here the keys' projection gates the values
(``sigmoid``), then causal attention over ``(b h)``; hidden 64, 4 heads of 16, 2 layers, 16 tokens.

Under ``--tp 2`` the heads are sharded, and ``(b h)`` holds each sample's heads: at a microbatch of 2 samples the
shard of dim 0 is two segments (sample 0's heads, sample 1's). The projection's rows are its own on every rank (its
weight whole, its gradient summed); read as a refusal ("input sharded on dim 0, not its features"), it made the
fused ``to_kv`` whole at microbatches of 2 or more, and only there (a share of 0.84).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class HeadsInBatchAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.to_kv = nn.Linear(D, 2 * HEADS * HEAD_DIM, bias=False)
        self.to_dynamic_proj = nn.Linear(HEAD_DIM, 1)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = (t.view(B, T, HEADS, HEAD_DIM).transpose(1, 2).reshape(B * HEADS, T, HEAD_DIM)  # '(b h) n d'
                   for t in (self.to_q(x), k, v))
        v = v * self.to_dynamic_proj(k).sigmoid()
        sim = q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        out = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1) @ v
        return self.to_out(out.view(B, HEADS, T, HEAD_DIM).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), HeadsInBatchAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
