"""Issue 57: nGPT's token embedding (nGPT-pytorch, ``nGPT.py``): the table held unit-norm through a parametrization
(``register_parametrization(token_embed, "weight", L2Norm(dim=-1))``, ``F.normalize`` of the weight on every call)
and read as ``self.token_embed.weight[ids]``, an ``aten.index`` of a table the model makes from its parameter.
``--cp 2`` refused it ("no value of the first stage holds a sequence shard": only a parameter indexed by token ids
began the shards); lit-gpt's attention and MLP otherwise, hidden 64, 4 heads, 16 tokens, 2 layers.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrize import register_parametrization
from lib_style import (D, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, rope_cache,  # noqa: F401
                       sgd, token_batch)


class L2Norm(nn.Module):
    def forward(self, t):
        return F.normalize(t, dim=-1, p=2)


class NormalizedTableDecoder(Decoder):
    def __init__(self):
        super().__init__(2, functools.partial(RMSNorm, D), functools.partial(SeparateAttention, 2), SwiGLU)
        register_parametrization(self.transformer.wte, "weight", L2Norm())

    def forward(self, idx):
        cos, sin = rope_cache(idx.shape[1])
        x = self.transformer.wte.weight[idx] * D ** 0.5
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


def model():
    torch.manual_seed(0)
    return NormalizedTableDecoder()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
