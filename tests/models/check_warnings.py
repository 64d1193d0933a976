"""A split `tracepp check` should warn about: a gate sent to three stages, and a last stage with no parameters."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.act = nn.Tanh()

    def forward(self, x):
        h = self.a(x)
        gate = torch.sigmoid(h)
        h = self.b(h) * gate
        h = self.c(h) * gate
        return self.act(h) * gate


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)


split_points = ["b", "c", "act"]
