"""Rank 1 stalls in batch(1) (as a hung data loader would): rank 0's wait for it must time out in our words."""
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


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


def batch(step):
    if step == 1 and os.environ.get("RANK") == "1":
        time.sleep(3600)
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 4, generator=g),), {}, torch.randn(4, 2, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(out, target):
    return F.mse_loss(out, target)


split_points = ["b"]
