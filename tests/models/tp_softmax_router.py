"""Issue 57: a router of a few outputs whose scores are normalised across them, as soft mixtures of experts and
routers write it (``softmax(router(x), dim=-1)`` weighing each expert's output; colt5-attention's
``CoordinateDescentRouter`` reads its routing tokens' scores with top-k alike): 2 SwiGLU experts mixed per token by a
``Linear(64, 2)`` router, beside lit-gpt-style grouped attention; 2 layers, hidden 64, 16 tokens.

The router is a linear of a whole input, so the walk starts it column-wise (one score per rank); the softmax across
the scores then needs them whole and gathers them: a column-wise region no row-wise linear closes, which Megatron's
plan never opens. ``tp_settle._unclosed`` finds it and the plan with the router whole on every rank is kept where it
costs less (here: no gather forward, no all-reduce of the scores' gradient backward).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, Decoder, GroupedFusedAttention, RMSNorm, SwiGLU, loss_fn, sgd, token_batch

EXPERTS = 2


class SoftExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList([SwiGLU() for _ in range(EXPERTS)])

    def forward(self, x):
        weights = self.router(x).softmax(dim=-1)
        return sum(weights[..., i:i + 1] * expert(x) for i, expert in enumerate(self.experts))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(GroupedFusedAttention, 2, layout="parts"),
                   SoftExperts)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
