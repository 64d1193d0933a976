"""Issue 57, failure class 2 (a crash): a Gemma-style config as lit-gpt builds Gemma-2B (``config.py``'s
``Gemma-2b``: one key/value group, multi-query attention, in one fused projection;
a GeGLU MLP, ``GemmaMLP``; RMSNorm with a unit offset; embeddings scaled by sqrt(hidden)), from
``lib_style``: litgpt 0.5's fused ``qkv`` (all query heads, then the key, then the value), rotary on each head's
first ``rope_n_elem`` features joined back to the rest (here empty) with ``cat``, the one key/value head
``repeat_interleave``d to the 4 query heads; 2 layers, hidden 64, 16 tokens.

``tracepp check --tp 2`` must plan it (the one key/value head stays whole beside each rank's query heads, as
Megatron-Core does under multi-query attention) and ``--tp 2`` must train equal to eager.
"""
import functools

import torch
from lib_style import D, Decoder, GeGLU, GroupedFusedAttention, RMSNorm, loss_fn, sgd, token_batch

KV_HEADS = 1


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D, add_unit_offset=True),
                   functools.partial(GroupedFusedAttention, KV_HEADS, layout="parts"), GeGLU,
                   embed_scale=True)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
