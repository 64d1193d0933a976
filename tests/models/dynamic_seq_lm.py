"""A causal LM whose batch size and sequence length change every step (dynamic dims 'batch' and 'seq').

`T = idx.shape[1]` is read once at the top and used by every layer, so a size crosses stage boundaries too.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

VOCAB, D, LAYERS, MAX_SEQ = 32, 16, 4, 32
SEQS = [12, 7, 16, 9]
BATCHES = [8, 8, 6, 10]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mix = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x, seq_len):
        h = self.mix(self.norm(x))
        # causal running mean over the sequence: position t sees positions <= t
        weights = torch.tril(torch.ones(seq_len, seq_len)) / torch.arange(1, seq_len + 1).unsqueeze(1)
        return x + self.out(torch.tanh(weights @ h))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(MAX_SEQ, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        seq_len = idx.shape[1]
        x = self.embed(idx) + self.pos(torch.arange(seq_len))
        for layer in self.layers:
            x = layer(x, seq_len)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Net()


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    shape = (BATCHES[step % 4], SEQS[step % 4])
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def example_inputs():
    return (_data(0)[0],)


def example_target():
    return _data(0)[1]


def batch(step):
    idx, target = _data(step)
    return (idx,), {}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


dynamic_shapes = {"idx": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=MAX_SEQ)}}
split_points = ["layers.2"]
