"""A forward with a ``torch.no_grad()`` block on a parameter, split in 2.

Export wraps the block in a ``wrap_with_set_grad_enabled`` higher-order op; tracepp inlines it (stages are
flat functions) and detaches its outputs, so no gradient flows through ``scale`` as in eager mode. ``same`` is
``h.to(h.dtype)`` made in the block: eager returns ``h`` itself, gradient and all (Dots3's indexer returns its
input so), so its gradient must flow on.
"""
import torch
import torch.nn as nn

from tracepp import pipe_split


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            scale = self.a.weight.abs().mean() + 1.0  # a statistic of a weight: no gradient through it
            same = h.to(h.dtype)  # h itself: its gradient flows
        pipe_split()
        return self.b(h * scale + same)


def model():
    torch.manual_seed(0)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(600 + step)
    return (torch.randn(4, 6, generator=g),), {}, torch.randn(4, 3, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
