"""A decoder whose queries and keys are scaled by a frozen table of sinusoids (RoFormer's position table: an
``nn.Embedding`` made with ``_freeze=True``, read at the positions and broadcast over the heads). The table takes no
gradient, so at tp 2 nothing sums one for it: the heads split over the ranks read it whole, and the values made from
it alone carry no gradient backward (``split/tp_settle.grad_flags``)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, FF, LAYERS, BATCH, SEQ = 48, 32, 4, 64, 2, 4, 8
HEAD = D // HEADS


def sinusoids(rows, dim):
    position = torch.arange(rows, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    return torch.cat([torch.sin(position * freq), torch.cos(position * freq)], dim=-1)


class Positions(nn.Embedding):
    def __init__(self, rows, dim):
        super().__init__(rows, dim, _weight=sinusoids(rows, dim), _freeze=True)

    def forward(self, seq):
        return super().forward(torch.arange(seq, device=self.weight.device))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x, table):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(b, s, HEADS, HEAD).transpose(1, 2) * table
        k = self.k_proj(h).view(b, s, HEADS, HEAD).transpose(1, 2) * table
        v = self.v_proj(h).view(b, s, HEADS, HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.positions = Positions(SEQ, HEAD)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        table = self.positions(idx.shape[1])[None, None]  # [1, 1, s, head]: every head reads it whole
        for layer in self.layers:
            x = layer(x, table)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (ids[:, :-1],), {}, ids[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)
