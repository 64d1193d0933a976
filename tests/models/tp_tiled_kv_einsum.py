"""x-transformers' grouped-query attention as export records it (``lib_style.TiledAttention``): 4 query heads, 2
key/value heads tiled to the query heads by einops' ``repeat(t, 'b kvh n d -> b (r kvh) n d')`` (``unsqueeze``,
``expand``, ``reshape``: query head i reads key/value head i % 2), interleaved partial rotary (``rotate_half``'s
``stack``), ``einsum`` scores and output; x-transformers' ``F.normalize`` RMSNorm, a SwiGLU MLP; 2 layers, hidden
64, 16 tokens.

Under ``--tp 2`` each rank holds one key/value head and the query heads that read it (heads {r, r + 2}: the query
projection's output features in two segments, rank r holding its piece of each), so every projection shards.
"""
import functools

import torch
from lib_style import D, Decoder, NormalizeRMSNorm, SwiGLU, TiledAttention, loss_fn, sgd, token_batch  # noqa: F401

KV_HEADS = 2


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(NormalizeRMSNorm, D), functools.partial(TiledAttention, KV_HEADS), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
