"""A forward-only model file (no loss_fn): an encoder returning a dict, with a skip connection across the split
and a keyword mask. `run.py --save-outputs` must write what eager `model()(*args, **kwargs)` returns per batch."""
import torch
import torch.nn as nn

D, BATCH, SEQ = 16, 6, 5


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.GELU()) for _ in range(4)])
        self.head = nn.Linear(D, 3)

    def forward(self, x, mask=None):
        h = self.embed(x)
        first = h
        for block in self.blocks:
            h = h + block(h)
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return {"scores": self.head(h + first), "pooled": h.mean(dim=1)}


def model():
    torch.manual_seed(0)
    return Encoder()


def batch(step):
    g = torch.Generator().manual_seed(7 + step)
    x = torch.randn(BATCH, SEQ, 4, generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    return (x,), {"mask": mask}, None


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return batch(0)[1]


split_points = ["blocks.2"]
