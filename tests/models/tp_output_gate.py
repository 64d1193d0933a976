"""Issue 57: an output gate computed from the merged heads themselves, as x-transformers writes its hybrid gated
attention (``attn_output_gate``, HyGA: ``gates = to_output_gate(out)``, a bias-less linear over the merged heads,
``out = out * sigmoid(gates)`` in head space, then ``to_out``); x-transformers' attention otherwise (2 key/value heads
tiled to 4 query heads, ``einsum`` scores), hidden 64, 2 layers, 16 tokens.

The gate's linear reads every head, so under ``--tp 2`` it is row-wise: its partial sums are summed, and each rank
multiplies its own heads by its piece of the gate. All-reduced whole and then read at the piece, the sum moved twice
what it needs; reduce-scattered over the gate's features, it moves half forward (the gradient is gathered backward,
as the read at the piece gathered it).
"""
import functools
import os

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


KV = int(os.environ.get("KV_HEADS", "2"))


class OutputGatedAttention(SeparateAttention):
    def __init__(self):
        super().__init__(KV)
        self.to_output_gate = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        out = self.heads(x, cos, sin).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM)  # 'b h n d -> b n (h d)'
        gates = self.to_output_gate(out).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)  # to head space
        out = out.view(B, T, HEADS, HEAD_DIM).transpose(1, 2) * gates.sigmoid()
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), OutputGatedAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
