"""Issue 57: keys and values from one fused projection, each then cut at half its heads, as sinkhorn-transformer
writes its causal attention (``SinkhornCausalAttention``: ``to_kv(x).chunk(2, dim=-1)``, each of k and v viewed into
heads, and ``apply_fn_after_split_ind(1, h // 2, rotate)``: the second half of the heads shifted along the sequence,
joined back by ``cat``); queries cut alike; plain causal attention after it; hidden 64, 4 heads, 2 layers, 16 tokens.

Under ``--tp 2`` each rank holds its piece of each half of each part: ``to_kv`` in 4 segments, ``to_q`` in 2. The cut
at half the heads inside one part of the fused projection (counted in heads, the part in features) asked the
projection for nothing it could use, and ``to_kv`` was whole (0.83 of each layer).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SwiGLU, einsum_attention, loss_fn, sgd, token_batch  # noqa: F401


def merge_heads(h, v):
    b, t, d = v.shape
    return v.view(b, t, h, -1).transpose(1, 2)


def rotate_second_half(t):
    half = t.shape[1] // 2
    left, right = t[:, :half], t[:, half:]
    return torch.cat((left, torch.roll(right, shifts=-1, dims=2)), dim=1)


class HalfRotatedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.to_kv = nn.Linear(D, 2 * HEADS * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = merge_heads(HEADS, self.to_q(x))
        k, v = (merge_heads(HEADS, t) for t in self.to_kv(x).chunk(2, dim=-1))
        q, k, v = map(rotate_second_half, (q, k, v))
        out = einsum_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), HalfRotatedAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
