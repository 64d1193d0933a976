"""Issue 57: linears written as ``einsum`` with a parameter, as recurrentgemma's PyTorch Griffin writes its MLP
(``layers.Einsum``: ``torch.einsum("...td,cdD->c...tD", x, self.w) + self.b``, the gate's and the up projection's
weights one ``[2, d, D]`` parameter, ``out[0]`` and ``out[1]`` picked apart) and as einops-style code writes a plain
projection (``einsum("b t d, d e -> b t e", x, w)``: the attention's output projection here, row-wise); lit-gpt's
attention otherwise, hidden 64, 4 heads, 2 layers, 16 tokens.

``--tp 2`` shards the gate/up weight on its last dim (the MLP's hidden features) and its bias with it, the down
projection row-wise, and the einsum output projection row-wise: Megatron's plan. The MLP was replicated before (an
einsum of a whole value and a parameter started no column-wise projection: 0.37 of Griffin's layers sharded).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, FFN, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, loss_fn, sgd, token_batch  # noqa: F401


class EinsumMLP(nn.Module):
    """recurrentgemma's ``MLPBlock``: ``ffw_up`` an ``Einsum`` of two parts, ``ffw_down`` an ``nn.Linear``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, D, FFN) / D ** 0.5)
        self.b = nn.Parameter(0.1 * torch.randn(2, 1, 1, FFN))
        self.ffw_down = nn.Linear(FFN, D)

    def forward(self, x):
        out = torch.einsum("...td,cdD->c...tD", x, self.w) + self.b
        return self.ffw_down(F.gelu(out[0]) * out[1])


class EinsumOutAttention(SeparateAttention):
    """The output projection as ``einsum("b t d, d e -> b t e")`` of a ``[d, e]`` parameter."""

    def __init__(self):
        super().__init__(HEADS)
        self.w_out = nn.Parameter(torch.randn(HEADS * HEAD_DIM, D) / D ** 0.5)

    def forward(self, x, cos, sin):
        y = self.heads(x, cos, sin).transpose(1, 2).flatten(2)
        return torch.einsum("b t d, d e -> b t e", y, self.w_out)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), EinsumOutAttention, EinsumMLP)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
