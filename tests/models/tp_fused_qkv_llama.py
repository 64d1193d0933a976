"""Issue 57, failure class 4 (twice the traffic): a Llama-style decoder as litgpt writes it (``lib_style``: one
fused projection for q, k and v, 2 key/value groups of 2 query heads, rotary positions on each head's first
``rope_n_elem`` features joined back to the rest with ``cat``, keys and values ``repeat_interleave``d, lit-gpt's
RMSNorm computed in fp32, a SwiGLU MLP); 2 layers, hidden 64, 16 tokens.

``QKV_LAYOUT`` picks the fused projection's layout: ``parts`` (default; litgpt 0.5: all query heads, then the keys,
then the values) or ``groups`` (lit-gpt before 0.5, Megatron-Core and torchtitan: ``[b, s, groups,
heads_per_group + 2, head_dim]``, each key/value group's query heads, its key, its value).

Megatron's plan for such a layer (and tracepp's for a Hugging Face Llama of the same sizes) is the fused
projection column-wise by heads, ``proj`` and the MLP's ``proj`` row-wise: 2 all-reduces of ``[b, s, hidden]`` per
layer forward (and 2 in backward), the residual stream whole between layers. ``--tp 2`` must move no more bytes than
that, and train equal to eager.
"""
import functools
import os

import torch
from lib_style import D, Decoder, GroupedFusedAttention, RMSNorm, SwiGLU, loss_fn, sgd, token_batch

KV_HEADS = 2
LAYOUT = os.environ.get("QKV_LAYOUT", "parts")


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(GroupedFusedAttention, KV_HEADS, layout=LAYOUT),
                   SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
