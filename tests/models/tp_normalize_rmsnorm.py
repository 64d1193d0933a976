"""Issue 57, failure class 1 (silently wrong): a decoder whose RMSNorm is x-transformers' ``F.normalize(x, dim=-1)
* sqrt(dim) * g`` (``lib_style.NormalizeRMSNorm``), with x-transformers' attention: separate q/k/v projections (4
query heads, 2 key/value heads tiled to the query heads) and its default ``einsum`` path; rotary positions, a
SwiGLU MLP; 2 layers, hidden 64, 16 tokens.

The tp plan keeps this attention whole (the tiled repeat and the einsum have no rule), so ``to_out`` is
column-wise and the residual stream is sharded on its features from there: the next norm's ``F.normalize`` meets
a sharded value. ``--tp 2`` must train equal to eager: the L2 norm over features is not a sum of the ranks' norms.
"""
import functools

import torch
from lib_style import Decoder, NormalizeRMSNorm, SeparateAttention, SwiGLU, D, loss_fn, sgd, token_batch

KV_HEADS = 2


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(NormalizeRMSNorm, D), functools.partial(SeparateAttention, KV_HEADS), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
