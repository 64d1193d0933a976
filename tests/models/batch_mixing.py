"""A decoder whose samples mix across the batch, as a library slip makes them mix (mixture-of-attention 0.0.25: its
router repeats the batch for each route, ``(b r)``, and gathers rows by ``arange(b)``, so sample ``i`` takes sample
``i // routes``'s tokens) and as statistics over the batch dim do (``MIX=center``: each token's hidden state centred
on the batch's mean, a batch-norm without its running statistics). Split into microbatches, each is computed apart:
the pipelined model is another function than the same model on the whole batch, and ``tracepp check`` says so.
``MIX=none``: the same decoder, each sample to itself (no warning); ``MIX=cached``: each sample to itself, with a bias
the MLP computes on its first call and keeps (x-transformers' ALiBi registers it as a buffer in forward): export runs forward on fake
tensors, so the check must run on a copy taken before (run after, the model computed with a fake bias and the split
failed). Hidden 64, 2 layers, a batch of 4 x 16 tokens.
"""
import functools
import os

import torch
import torch.nn as nn
from lib_style import D, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

MIX = os.environ.get("MIX", "gather")


class MixingMLP(SwiGLU):
    def __init__(self):
        super().__init__()
        self.register_buffer("cached", None, persistent=False)

    def forward(self, x):
        if MIX == "cached":
            if self.cached is None or self.cached.shape[0] != x.shape[1]:
                self.register_buffer("cached", torch.arange(x.shape[1], device=x.device, dtype=x.dtype)[:, None] * 1e-3,
                                     persistent=False)
            x = x + self.cached
        if MIX == "gather":  # the rows of sample i // 2 for sample i
            routed = x.repeat_interleave(2, dim=0)[torch.arange(x.shape[0], device=x.device)]  # "(b r)"
            x = 0.5 * (x + routed)
        elif MIX == "center":
            x = x - x.mean(dim=0, keepdim=True)
        return super().forward(x)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(SeparateAttention, 4), MixingMLP)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
