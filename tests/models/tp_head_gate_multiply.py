"""Issue 57: a gate per head and position on the attention's output, as x-transformers writes it with einx
(``attn_gate_value_heads``: ``einx.multiply('b n h, b h n d -> b h n d', head_gate.sigmoid(), out)``, which calls
``torch.multiply``: in the graph ``permute``, ``reshape`` to ``[b, h, n, 1]`` and ``aten.multiply.Tensor``, the
numpy-style name of ``mul`` that torch does not tag pointwise); x-transformers' attention otherwise (keys and values
tiled to the query heads, ``einsum`` scores), hidden 64, 4 query heads, 2 key/value heads, 2 layers, 16 tokens.

``--tp 2`` shards the gate's projection by heads, in the query heads' segments, and the attention with it; ``--cp 2``
gates each rank's positions. ``aten.multiply`` had no rule: the attention was whole under tp (0.55 of a stage) and
refused under cp ("multiply ... mixes the positions of the sequence").
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class HeadGatedAttention(SeparateAttention):
    def __init__(self):
        super().__init__(2)
        self.to_v_head_gate = nn.Linear(D, HEADS)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        out = self.heads(x, cos, sin)  # [b, h, n, d]
        gate = self.to_v_head_gate(x).sigmoid()  # [b, n, h]
        out = torch.multiply(gate.permute(0, 2, 1).reshape(B, HEADS, T, 1), out)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), HeadGatedAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
