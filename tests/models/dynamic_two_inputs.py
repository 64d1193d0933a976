"""Two inputs whose sequence lengths must match (one dynamic dim 'seq' shared by both).

Step 0 is fine; step 1's length is outside the declared range; step 2's two inputs disagree. Which step
misbehaves is chosen by the test through TRACEPP_TEST_BAD_STEP (1 or 2).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, 1)

    def forward(self, x, weight):
        h = torch.tanh(self.a(x)) * weight.unsqueeze(-1)
        return self.b(h).squeeze(-1)


def model():
    torch.manual_seed(0)
    return Net()


def batch(step):
    bad = int(os.environ.get("TRACEPP_TEST_BAD_STEP", "-1"))
    seq, seq_w = 6, 6
    if step == bad == 1:
        seq = seq_w = 40  # beyond max=16
    if step == bad == 2:
        seq, seq_w = 7, 5  # contradicts the traced relation: both are 'seq'
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, seq, D, generator=g), torch.rand(4, seq_w, generator=g)), {}, torch.randn(4, seq, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(out, target):
    return F.mse_loss(out, target)


split_points = ["b"]
