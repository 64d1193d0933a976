"""KAN-GPT's MLP (pip ``kan_gpt``, ``efficient_kan/model.py``, ``KANLinear``, written out here as it writes it): each
linear is ``F.linear(silu(x), base_weight)`` plus the inputs' cubic B-spline bases (comparisons against a grid buffer,
then the Cox-de Boor recursion) flattened ``[n, in * 8]`` times ``spline_weight * spline_scaler.unsqueeze(-1)`` viewed
``[out, in * 8]``: a weight made of two parameters on every call. The decoder is lib_style's (fused attention by
parts, RMSNorm), the MLP ``c_fc`` (64 -> 128), GELU, ``c_proj`` (128 -> 64), each a KANLinear on ``x.view(-1, in)``.

``--tp 2`` must hold both parameters of each spline weight by its output features in ``c_fc`` and its input features
in ``c_proj`` (a derived weight was read through to one parameter only: the spline linear stayed whole, and the
residual add beside the sharded base linear made every layer whole, 0.00 of each layer in the study).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, Decoder, GroupedFusedAttention, RMSNorm, loss_fn, sgd, token_batch

GRID, ORDER = 5, 3


class KANLinear(nn.Module):
    def __init__(self, in_features, out_features, grid_range=(-1, 1)):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        h = (grid_range[1] - grid_range[0]) / GRID
        grid = (torch.arange(-ORDER, GRID + ORDER + 1) * h + grid_range[0]).expand(in_features, -1).contiguous()
        self.register_buffer("grid", grid)
        self.base_weight = nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.spline_weight = nn.Parameter(torch.randn(out_features, in_features, GRID + ORDER) * 0.1)
        self.spline_scaler = nn.Parameter(1.0 + 0.1 * torch.randn(out_features, in_features))

    def b_splines(self, x):
        grid = self.grid
        x = x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for k in range(1, ORDER + 1):
            bases = ((x - grid[:, : -(k + 1)]) / (grid[:, k:-1] - grid[:, : -(k + 1)]) * bases[:, :, :-1]) + (
                (grid[:, k + 1:] - x) / (grid[:, k + 1:] - grid[:, 1:(-k)]) * bases[:, :, 1:])
        return bases.contiguous()

    @property
    def scaled_spline_weight(self):
        return self.spline_weight * self.spline_scaler.unsqueeze(-1)

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.in_features)
        base_output = F.linear(F.silu(x), self.base_weight)
        spline_output = F.linear(self.b_splines(x).view(x.size(0), -1),
                                 self.scaled_spline_weight.view(self.out_features, -1))
        return (base_output + spline_output).view(*shape[:-1], self.out_features)


class KANMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = KANLinear(D, 2 * D), KANLinear(2 * D, D)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(GroupedFusedAttention, 2, layout="parts"),
                   KANMLP)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
