"""Issue 57: a per-position scalar gate made by a matmul with a vector weight, ``sigmoid(x @ w)`` with ``w`` of shape
``[dim]`` (hyper-connections' ``normed @ self.dynamic_beta_fn``, lucidrains' local-attention and x-transformers'
residual streams), scaling each position's attention output; hidden 64, 4 heads, 16 tokens.

``--cp 2`` carries the sequence shard through ``x @ w`` (refused before: a matmul with a 1-D operand had no cp rule,
"mixes the positions of the sequence").
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEADS, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class GatedAttention(SeparateAttention):
    def __init__(self):
        super().__init__(HEADS)
        self.gate = nn.Parameter(0.1 * torch.randn(D))

    def forward(self, x, cos, sin):
        return super().forward(x, cos, sin) * torch.sigmoid(x @ self.gate)[..., None]


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), GatedAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
