"""Issue 57: residual adds replaced by a GRU cell, as x-transformers' ``gate_residual=True`` writes them
(``GRUGating``: ``nn.GRUCell(dim, dim)`` of the branch's output and the residual, over the ``(b n)`` rows, reshaped
back); lit-gpt's attention and SwiGLU otherwise, hidden 64, 4 query heads, 2 key/value heads, 2 layers, 16 tokens.

``--tp 2`` writes each cell out (``split/decompose.py``: its two linears and the gates) and shards the cell's
weights by hidden units, each of its three gates' rows (reset, update, new) in a segment, the state read at this
rank's units and the new state gathered once. Before, ``aten.gru_cell`` had no rule: its weights, more than half of
each layer, were whole on every rank (x-transformers' relative-position decoder: 0.33 of each layer).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, Block, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class GRUGating(nn.Module):
    """x-transformers' ``GRUGating``."""

    def __init__(self, dim):
        super().__init__()
        self.gru = nn.GRUCell(dim, dim)

    def forward(self, x, residual):
        gated_output = self.gru(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]))
        return gated_output.reshape_as(x)


class GatedBlock(Block):
    def __init__(self, norm, attention, mlp):
        super().__init__(norm, attention, mlp)
        self.gate_1, self.gate_2 = GRUGating(D), GRUGating(D)

    def forward(self, x, cos, sin):
        x = self.gate_1(self.attn(self.norm_1(x), cos, sin), x)
        return self.gate_2(self.mlp(self.norm_2(x)), x)


def model():
    torch.manual_seed(0)
    decoder = Decoder(2, functools.partial(RMSNorm, D), lambda: SeparateAttention(2), SwiGLU)
    decoder.transformer.h = nn.ModuleList(
        [GatedBlock(functools.partial(RMSNorm, D), lambda: SeparateAttention(2), SwiGLU) for _ in range(2)])
    return decoder


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
