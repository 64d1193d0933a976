"""``cp_normalize_rmsnorm.py``'s decoder with its RMSNorm written ``x / torch.linalg.norm(x, dim=-1, keepdim=True)``
(``lib_style.LinalgNormRMSNorm``): ``aten.linalg_norm`` was in no family of the rules, so ``--cp 2`` refused it as
an op that mixes positions. It is a norm over the features: each position's row stays on the rank that holds it.
"""
import functools

import torch
from cp_normalize_rmsnorm import (KV_HEADS, batch, example_inputs, example_target, loss_fn,  # noqa: F401
                                  optimizer)
from lib_style import D, Decoder, LinalgNormRMSNorm, SeparateAttention, SwiGLU


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(LinalgNormRMSNorm, D),
                   functools.partial(SeparateAttention, KV_HEADS, flash=True), SwiGLU)
