"""A gated MLP for tensor parallelism: a per-token gate (one output feature, so it stays whole) scales the
column-parallel hidden features before the row-parallel projection.

The gate is broadcast along the sharded hidden dim, so each tp rank sees only its share of the features it
scales: its gradient (and the gate weight's) must be summed over the group, or training drifts from eager.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, LAYERS, BATCH, SEQ = 32, 16, 32, 2, 4, 8


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 1)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)) * torch.sigmoid(self.gate(x)))


class GatedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([GatedMLP() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return GatedLM()


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5)
