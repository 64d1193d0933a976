"""``cp_normalize_rmsnorm.py``'s decoder with its RMSNorm written ``x / torch.linalg.norm(x, dim=-1, keepdim=True)``
(``lib_style.LinalgNormRMSNorm``): ``aten.linalg_norm`` was in no family of the rules, so ``--cp 2`` refused it as
an op that mixes positions. It is a norm over the features: each position's row stays on the rank that holds it.
"""
import functools

import torch
from lib_style import D, Decoder, LinalgNormRMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

KV_HEADS = 2


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(LinalgNormRMSNorm, D),
                   functools.partial(SeparateAttention, KV_HEADS, flash=True), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
