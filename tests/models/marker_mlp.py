"""An MLP whose forward marks its own stage boundary with tracepp.pipe_split()."""
import torch
import torch.nn as nn

from tracepp import pipe_split


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.c = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        pipe_split()
        return self.c(torch.relu(self.b(h)))


def model():
    torch.manual_seed(0)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 8, generator=g),), {}, torch.randn(4, 4, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
