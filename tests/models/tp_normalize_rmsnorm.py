"""Issue 57, failure class 1 (silently wrong): a decoder whose RMSNorm is x-transformers' ``F.normalize(x, dim=-1)
* sqrt(dim) * g`` (``lib_style.NormalizeRMSNorm``), with x-transformers' attention: separate q/k/v projections (4
query heads, 2 key/value heads tiled to the query heads) and its default ``einsum`` path; rotary positions, a
SwiGLU MLP; 2 layers, hidden 64, 16 tokens.

Its einsum attention runs on each rank's heads (the tiled keys and values read whole at each rank's piece), so the
residual stream stays whole; ``tp_normalize_ffn`` puts the same norm inside the MLP, on its sharded hidden
features. ``--tp 2`` must train equal to eager.
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
