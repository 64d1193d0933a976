"""0-dim parameters, as x-transformers' Dynamic Tanh writes its norm (``use_dynamic_tanh``: ``DynamicTanh``,
``pre_tanh_scale = nn.Parameter(tensor(init_alpha))``, then ``tanh(x * pre_tanh_scale) * gamma + beta``; Zhu et al.
2025, "Transformers without Normalization") in place of every RMSNorm of lit-gpt's decoder (lib_style); 2 layers,
hidden 64, 4 heads over 2 key/value heads.

FSDP2 (``--dp``, and ``--cp`` whose FSDP/DDP wraps dp x cp) refuses a 0-dim parameter ("fully_shard doesn't support
scalar parameters"): the ranks stopped at start-up. They are now left out of FSDP/DDP and their gradients averaged
over the same ranks (``runtime/mesh.py``: ``scalars``, ``reduce_scalar_grads``).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, Decoder, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401 (the contract)


class DynamicTanh(nn.Module):
    def __init__(self, dim, init_alpha=1.0):
        super().__init__()
        self.pre_tanh_scale = nn.Parameter(torch.tensor(init_alpha))
        self.gamma = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return (x * self.pre_tanh_scale).tanh() * self.gamma + self.beta


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(DynamicTanh, D, 0.8), functools.partial(SeparateAttention, 2), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
