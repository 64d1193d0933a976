"""Four stages with a skip connection from stage 0 to stage 3, for V placement tests.

``h0`` leaves stage 0 for stage 1 (on the other rank of a 2-rank V) and for stage 3 (on stage 0's own rank):
in forward it is both sent and handed over in memory; in backward its gradient is the sum of one received
from stage 1 and one handed back in memory by stage 3. The ``pipe_split()`` markers fix the stages.
"""
import torch
import torch.nn as nn

from tracepp import pipe_split

D_IN, D, D_OUT, BATCH = 6, 10, 3, 8


class SkipV(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.mid1 = nn.Linear(D, D)
        self.mid2 = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x):
        h0 = torch.tanh(self.inp(x))
        pipe_split()
        h1 = torch.tanh(self.mid1(h0))
        pipe_split()
        h2 = torch.tanh(self.mid2(h1))
        pipe_split()
        return self.out(h2 * torch.sigmoid(self.gate(h0)) + h0)  # h0 skips stages 1 and 2


def model():
    torch.manual_seed(0)
    return SkipV()


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(BATCH, D_IN, generator=g),), {}, torch.randn(BATCH, D_OUT, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
