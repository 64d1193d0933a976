"""Issue 57: tokens routed by learned routing tokens, as colt5-attention's ``CoordinateDescentRouter`` (which
mixture-of-attention and CoLT5 use) writes it, reduced: scores ``einsum('b n d, r d -> b r n', x, routing_token)``
for 2 routes, each route's top 4 tokens gathered, a linear over them, weighed by their scores and ``scatter_add``ed
back, beside lit-gpt-style grouped attention and a SwiGLU MLP; 2 layers, hidden 64, 16 tokens.

The routing tokens are a linear's weight to the walk (one route's scores per rank); the routed rows then follow the
routes until ``scatter_add`` needs them whole: a column-wise region no row-wise linear closes, which Megatron's plan
never opens. ``tp_settle._unclosed`` finds it; the plan with the routing tokens whole on every rank costs less and is
kept (mixture-of-attention's routers: its layers' bytes 32 -> 22 KiB and 40 -> 30 KiB per microbatch).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, Decoder, GroupedFusedAttention, RMSNorm, SwiGLU, loss_fn, sgd, token_batch

ROUTES, TOP = 2, 4


class RoutedTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.routing_token = nn.Parameter(torch.randn(ROUTES, D) / D ** 0.5)
        self.proj = nn.Linear(D, D, bias=False)
        self.mlp = SwiGLU()

    def forward(self, x):
        b, n, d = x.shape
        scores = torch.einsum("b n d, r d -> b r n", x, self.routing_token).sigmoid()
        top, idx = scores.topk(TOP, dim=-1)  # [b, routes, top]
        rows = idx.reshape(b, ROUTES * TOP, 1).expand(b, ROUTES * TOP, d)
        routed = self.proj(x.gather(1, rows)) * top.reshape(b, ROUTES * TOP, 1)
        return self.mlp(x) + torch.zeros_like(x).scatter_add(1, rows, routed)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(GroupedFusedAttention, 2, layout="parts"),
                   RoutedTokens)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
