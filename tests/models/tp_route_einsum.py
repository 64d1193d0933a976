"""Issue 57: keys and values of every route from one projection's weight, rearranged per route and applied by
``einsum``, as CoLT5 writes its heavy attention (``colt5_attention``'s ``Attention``: ``kv_weight =
rearrange(self.to_kv.weight, '(r h d) i -> r h d i')``, ``einsum('r h d i, b r n i -> b r h n d', kv_weight,
context)``, then ``chunk(2, dim=-1)`` into keys and values and ``'b r h n d -> b (r h) n d'``): the weight's first
labels are a batch label (the route) and its own heads. ``ROUTES`` routes (1 by default; 2: each route's context the
input scaled by its own learned gain, the heads shared out between the routes), 4 heads of 16, hidden 64, 2 layers.

Under ``--tp 2`` the weight is read through the rearrange to its parameter and sharded on its heads (in the routes'
segments): it was whole ("read whole by aten.einsum, whose inputs are whole"), 0.85 of each layer.
"""
import functools
import os

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SwiGLU, einsum_attention, loss_fn, sgd, token_batch  # noqa: F401

ROUTES = int(os.environ.get("ROUTES", "1"))


class RoutedKVAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.to_kv = nn.Linear(D, 2 * HEADS * HEAD_DIM, bias=False)
        self.route_gain = nn.Parameter(torch.linspace(0.5, 1.5, ROUTES))
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        context = x.unsqueeze(1) * self.route_gain[None, :, None, None]  # [b, r, n, i]
        per_route = HEADS // ROUTES
        kv_weight = self.to_kv.weight.reshape(ROUTES, per_route, 2 * HEAD_DIM, D)  # '(r h d) i -> r h d i'
        kv = torch.einsum("r h d i, b r n i -> b r h n d", kv_weight, context)
        k, v = (t.reshape(B, ROUTES * per_route, T, HEAD_DIM) for t in kv.chunk(2, dim=-1))  # 'b (r h) n d'
        out = einsum_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), RoutedKVAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
