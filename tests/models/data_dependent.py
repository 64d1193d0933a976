"""A model export cannot trace: Python control flow on a tensor's value."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h * 2
        return h


def model():
    return Net()


def example_inputs():
    return (torch.randn(4, 4),)
