"""Issue 57: LoRA on a fused qkv projection as litgpt writes it (``litgpt/lora.py``, ``LoRAQKVLinear``, litgpt 0.5):
``after_A = F.linear(x, lora_A)`` (rank 4 per part, q, k and v), transposed to ``[b, 3 * rank, t]``, chunked into the
three parts and each multiplied by its own rows of ``lora_B`` with a ``conv1d`` of a kernel of 1
(``F.conv1d(a, b)`` for ``zip(after_A.chunk(3, dim=1), lora_B.unsqueeze(-1).split(qkv_shapes))``, the parts unequal
under grouped-query attention), ``cat`` back on the channels, transposed and added, scaled, to the frozen projection's
output; lit-gpt's attention (``layout="parts"``, 4 query heads, 2 key/value heads) and SwiGLU otherwise, hidden 64, 2
layers, 16 tokens. The projection and its adapter train; the rest is frozen, as a LoRA fine-tune.

``--tp 2`` holds the projection and ``lora_B`` column-wise in the q, k and v parts (each rank its heads' rows of
each) and makes ``lora_A``'s 12 rank features whole before the convolutions read them, as PEFT's tensor-parallel LoRA
does (there ``lora_A`` is whole). Before, the 1 x 1 convolution had no tp rule and the whole
attention ran on every rank (litgpt's LoRA model: 0.66 of each layer).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEADS, HEAD_DIM, Decoder, GroupedFusedAttention, RMSNorm, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

GROUPS, RANK, ALPHA = 2, 4, 8


class LoRAQKVLinear(nn.Module):
    """litgpt's ``LoRAQKVLinear`` with ``enable_lora`` on q, k and v (no zero padding)."""

    def __init__(self):
        super().__init__()
        self.qkv_shapes = (HEADS * HEAD_DIM, GROUPS * HEAD_DIM, GROUPS * HEAD_DIM)
        self.linear = nn.Linear(D, sum(self.qkv_shapes), bias=False)
        self.linear.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(RANK * 3, D) / D ** 0.5)
        self.lora_B = nn.Parameter(0.02 * torch.randn(sum(self.qkv_shapes), RANK))
        self.scaling = ALPHA / RANK

    def conv1d(self, input, weight):
        input_splitted = input.chunk(3, dim=1)
        weight_splitted = weight.split(self.qkv_shapes)
        return torch.cat([F.conv1d(a, b) for a, b in zip(input_splitted, weight_splitted)], dim=1)

    def forward(self, x):
        pretrained = self.linear(x)
        after_A = F.linear(x, self.lora_A)
        after_B = self.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1)).transpose(-2, -1)
        return pretrained + after_B * self.scaling


class LoRAAttention(GroupedFusedAttention):
    def __init__(self):
        super().__init__(GROUPS, layout="parts")
        self.attn = LoRAQKVLinear()


def model():
    torch.manual_seed(0)
    decoder = Decoder(2, functools.partial(RMSNorm, D), LoRAAttention, SwiGLU)
    for name, param in decoder.named_parameters():
        if "lora_" not in name:
            param.requires_grad_(False)
    return decoder


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
