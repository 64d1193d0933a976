"""A forward with a ``torch.autocast(enabled=False)`` block (as older HF rotary embeddings have), split in 2.

Export wraps the block in ``wrap_with_autocast``; tracepp inlines it and turns autocast off around it in the
stage code, so under ``--precision bf16`` its matmul still runs in fp32, as in eager autocast.
"""
import torch
import torch.nn as nn

from tracepp import pipe_split


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.register_buffer("freq", torch.linspace(0.5, 3.0, 8), persistent=False)

    def forward(self, x):
        h = self.a(x)
        with torch.autocast(x.device.type, enabled=False):
            table = torch.cos(x[:, :1].float() @ self.freq[None, :] * 37.0)  # precision-sensitive, kept fp32
        pipe_split()
        return self.b(h * table)


def model():
    torch.manual_seed(0)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    return (torch.randn(4, 6, generator=g) * 10,), {}, torch.randn(4, 3, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(out, target):
    return ((out.float() - target) ** 2).mean()
