"""A value made on stage 0 and read on stage 2 (a skip connection across a 3-stage split).

``h0`` leaves stage 0 for both stage 1 and stage 2; in backward, the gradients from both consumers must be
summed before stage 0's backward runs. The markers are ``pipe_split()`` calls, so the stages are fixed.
Two buffers: ``in_shift`` (non-persistent, read on stage 0 only) and ``out_scale`` (persistent, read on stage
2 only, so the checkpoint must gather it from the last rank).
"""
import torch
import torch.nn as nn

from tracepp import pipe_split

D_IN, D, D_OUT, BATCH = 6, 12, 3, 8


class Skip3(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.mid1 = nn.Linear(D, D)
        self.mid2 = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)
        self.register_buffer("in_shift", torch.linspace(-0.2, 0.2, D_IN), persistent=False)
        self.register_buffer("out_scale", torch.linspace(0.5, 1.5, D_OUT))

    def forward(self, x):
        h0 = torch.tanh(self.inp(x + self.in_shift))
        pipe_split()
        h1 = torch.tanh(self.mid1(h0))
        h1 = torch.tanh(self.mid2(h1))
        pipe_split()
        # h0 skips stage 1: multiplied so its gradient depends on both paths
        return self.out(h1 * torch.sigmoid(self.gate(h0)) + h0) * self.out_scale


def model():
    torch.manual_seed(0)
    return Skip3()


def batch(step):
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn(BATCH, D_IN, generator=g),), {}, torch.randn(BATCH, D_OUT, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
