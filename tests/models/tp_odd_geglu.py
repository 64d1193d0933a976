"""A fused q, k, v projection viewed as ``[b, n, 3, heads, d]`` (einops' ``'b n (qkv h d) -> qkv b h n d'``, as
lucidrains' infini-transformer and many others write it) beside a GEGLU feed-forward whose one fused ``proj_in``
is chunked in two halves of an odd width (``int(mult * dim * 2 / 3)``: 85 at ``ff_mult=2``, dim 64), as
infini-transformer-pytorch's ``FeedForward`` builds it. 2 layers, hidden 64, 4 heads of 16, 16 tokens.

Under ``--tp 2`` the fused q, k, v learns its 3 parts from the view while the odd halves make ``proj_in`` whole, in
the same pass. The pass that learned the parts used to go on deciding as if they were not learned: the view was
found to need its input whole, ``to_qkv`` was made whole with it, and every layer ended whole (a share of 0).
The attention is now sharded by heads and only the feed-forward is whole.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, loss_fn, sgd, token_batch  # noqa: F401

INNER = int(2 * D * 2 / 3)  # 85


class PackedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(D, 3 * HEADS * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.to_qkv(x).view(B, T, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class OddGeGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(D, INNER * 2)
        self.proj_out = nn.Linear(INNER, D)

    def forward(self, x):
        x, gates = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(F.gelu(gates) * x)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), PackedAttention, OddGeGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
