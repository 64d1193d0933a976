"""loss_fn raises on step 1, which runs only on the last stage's rank: the other rank must not hang."""
import torch
import torch.nn as nn
import torch.nn.functional as F

_calls = {"n": 0}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 4),)


def example_target():
    return torch.randn(4, 2)


def loss_fn(out, target):
    _calls["n"] += 1
    if _calls["n"] > 2:  # the first step's two microbatches pass, the second step fails
        raise RuntimeError("simulated failure inside loss_fn")
    return F.mse_loss(out, target)


split_points = ["b"]
