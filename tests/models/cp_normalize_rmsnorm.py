"""Issue 57, failure class 3 (a false refusal): x-transformers' RMSNorm ``F.normalize(x, dim=-1) * sqrt(dim) * g``
(``lib_style.NormalizeRMSNorm``) in a decoder whose attention is x-transformers' ``attn_flash=True`` path
(``F.scaled_dot_product_attention`` on key/value heads tiled to the query heads), rotary positions, a SwiGLU MLP;
2 layers, hidden 64, 4 query heads, 2 key/value heads, 16 tokens.

``--cp 2`` must place the norm: ``F.normalize`` divides each position's features by their L2 norm
(``linalg_vector_norm`` over the last dim, ``clamp_min``, ``expand_as``, ``div``), so each position's row stays
on the rank that holds it.
"""
import functools

import torch
from lib_style import Decoder, NormalizeRMSNorm, SeparateAttention, SwiGLU, D, loss_fn, sgd, token_batch

KV_HEADS = 2


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(NormalizeRMSNorm, D),
                   functools.partial(SeparateAttention, KV_HEADS, flash=True), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
