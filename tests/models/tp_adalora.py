"""PEFT's AdaLoRA adapters (``peft/tuners/adalora/layer.py``, ``SVDLinear.forward``) on every projection of a small
decoder (``lib_style``'s separate-projection attention and SwiGLU): ``result = base(x)`` then ``result += (dropout(x) @
(lora_A * lora_E).T @ lora_B.T) * scaling / ranknum``, with ``lora_A`` ``[r, in]``, the singular values ``lora_E``
``[r, 1]`` and ``lora_B`` ``[out, r]`` (rank 4), the base weights frozen.

Beside a row-parallel base (``to_out``, ``proj``) ``x`` is sharded on its features: ``lora_A * lora_E`` is read at the
rank's columns, and ``lora_A`` is held as those columns (PEFT's LoraParallelLinear: A row-wise, its latent all-reduced,
B whole), ``lora_E`` whole with its gradient summed over tp. ``lora_A`` was whole on every rank, read at its piece.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, FFN, HEADS, RMSNorm, SeparateAttention, SwiGLU, Decoder, loss_fn, token_batch  # noqa: F401

RANK = 4


class SVDLinear(nn.Module):
    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base
        self.base_layer.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(RANK, base.in_features) * 0.3)
        self.lora_E = nn.Parameter(torch.randn(RANK, 1))
        self.lora_B = nn.Parameter(torch.randn(base.out_features, RANK) * 0.3)
        self.ranknum = nn.Parameter(torch.tensor(float(RANK)), requires_grad=False)
        self.scaling = 2.0

    def forward(self, x):
        result = self.base_layer(x)
        ranknum = self.ranknum + 1e-5
        result += (x @ (self.lora_A * self.lora_E).T @ self.lora_B.T) * self.scaling / ranknum
        return result


def _adapted(module):
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name != "lm_head":
            setattr(module, name, SVDLinear(child))
        else:
            _adapted(child)
    return module


def model():
    torch.manual_seed(0)
    decoder = Decoder(2, functools.partial(RMSNorm, D), functools.partial(SeparateAttention, HEADS), SwiGLU)
    for param in decoder.parameters():
        param.requires_grad_(False)
    _adapted(decoder)
    return decoder


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def optimizer(params):
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.5)
