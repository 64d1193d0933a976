"""Traced with sequence length 6; step 1's batch has length 5 (the shape is static)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 6),)


def example_target():
    return torch.randn(4, 3)


def batch(step):
    width = 6 if step == 0 else 5
    return (torch.randn(4, width),), {}, torch.randn(4, 3)


def loss_fn(out, target):
    return F.mse_loss(out, target)


split_points = ["b"]
