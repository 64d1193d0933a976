"""A decoder-like stack whose MLPs run under ``torch.autocast(dtype=torch.bfloat16)`` inside ``forward`` (with an
``autocast(enabled=False)`` norm nested in that region, as OLMo-core writes its norms), split in 2.

Export records the enabled region's ops without the casts autocast inserts (its ``linear`` reads fp32 tensors and
is recorded bf16); tracepp traces the region again under its autocast so the casts are ops of the stage graph, and
the split trains equal to eager autocast.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, FFN, VOCAB, OLMoRMSNorm, loss_fn, sgd, token_batch


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = OLMoRMSNorm(D)
        self.up = nn.Linear(D, FFN)
        self.down = nn.Linear(FFN, D)

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            h = self.down(F.gelu(self.up(self.norm(x))))
        return x + h.float()


class Net(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Net()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
