"""A block's output projected by a square linear and added into the residual stream before the next mixer, as
Zamba2's hybrid layer adds its shared transformer block's output (``self.linear``) to the stream entering the Mamba
layer, whose RMSNorm is written out in elementwise ops; the stream is read again by the residual add after the
mixer. The projection's input is whole (a row-wise MLP's output), so the walk makes it column-wise: its sharded
output then meets the whole stream. Reading the stream at each rank's piece there (as a gated product on its way to
a linear is read) shards the stream itself from that layer on, and every later mixer's input projection becomes
row-wise, all-reducing its wide output (Zamba2 at its default size: 2.3x the bytes of each stage).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, BATCH, SEQ = 32, 16, 32, 4, 8


class RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_norm = RMSNorm(D)
        self.shared = MLP()
        self.linear = nn.Linear(D, D, bias=False)
        self.norm = RMSNorm(D)
        self.mixer = MLP()

    def forward(self, x):
        projected = self.linear(self.shared(self.shared_norm(x)))
        mixed = self.mixer(self.norm(x + projected))
        return x + mixed


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(2400 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
