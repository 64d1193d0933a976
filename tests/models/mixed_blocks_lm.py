"""A small LM whose numbered blocks do not all trace to the same graph, for the block extraction tests.

``layers.0`` and ``layers.2`` are GELU blocks, ``layers.1`` and ``layers.3`` ReLU blocks (alternating layer
types, as Gemma2's sliding and global attention), ``layers.4`` is wider: the rank script gets one function
per distinct graph met twice or more (GELU, ReLU) and the wide block inline.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, SEQ, BATCH = 20, 8, 5, 4


class Block(nn.Module):
    def __init__(self, width, act):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, width)
        self.act = act
        self.down = nn.Linear(width, D)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


class MixedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(16, nn.GELU()), Block(16, nn.ReLU()), Block(16, nn.GELU()),
                                     Block(16, nn.ReLU()), Block(24, nn.GELU())])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return MixedLM()


def _data(step):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return (_data(0)[0],)


def example_target():
    return _data(0)[1]


def batch(step):
    idx, target = _data(step)
    return (idx,), {}, target


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
