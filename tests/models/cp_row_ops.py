"""Issue 57: ops context parallelism refused by name though they keep each position apart, as x-transformers writes
them (``x_transformers.py``, ``attend.py``): talking heads (``attn_pre_talking_heads``: a ``Conv2d(heads, heads, 1)``
over the scores, each query/key pair's heads mixed on their own), attention on attention (``attn_on_attn``: the
output projected to twice the width, then ``nn.GLU()`` over the features) and a gated residual
(``gate_residual``: ``nn.GRUCell`` over the ``(b n)`` rows, the branch's output its input and the residual its
state). Refused before as "a convolution along the sequence dim", and "glu" / "gru_cell" "mix the positions";
hidden 64, 4 heads, 16 tokens, 2 layers.
"""
import functools

import torch
import torch.nn as nn
from lib_style import (D, HEADS, HEAD_DIM, Decoder, RMSNorm, SwiGLU, apply_rope, loss_fn, sgd,  # noqa: F401
                       token_batch)


class TalkingHeadsAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(D, 3 * HEADS * HEAD_DIM, bias=False)
        self.pre_softmax_talking_heads = nn.Conv2d(HEADS, HEADS, 1, bias=False)
        self.to_out = nn.Sequential(nn.Linear(HEADS * HEAD_DIM, 2 * D, bias=False), nn.GLU())

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.to_qkv(x).view(B, T, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5
        sim = self.pre_softmax_talking_heads(sim)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class GRUGating(nn.Module):
    """x-transformers' ``GRUGating``: the residual through a GRU cell whose input is the branch's output."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRUCell(D, D)

    def forward(self, x, residual):
        return self.gru(x.reshape(-1, D), residual.reshape(-1, D)).reshape_as(x)


class GatedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1, self.attn, self.gate_1 = RMSNorm(D), TalkingHeadsAttention(), GRUGating()
        self.norm_2, self.mlp = RMSNorm(D), SwiGLU()

    def forward(self, x, cos, sin):
        x = self.gate_1(self.attn(self.norm_1(x), cos, sin), x)
        return x + self.mlp(self.norm_2(x))


def model():
    torch.manual_seed(0)
    net = Decoder(2, functools.partial(RMSNorm, D), lambda: nn.Identity(), lambda: nn.Identity())
    net.transformer.h = nn.ModuleList([GatedBlock() for _ in range(2)])
    return net


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
