"""The tied-embedding LM of tied_lm.py trained with AdamW: the data-parallel tests (issue 11) run it on a
2 pipeline ranks x 2 replicas mesh and compare with eager AdamW on the global batch.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, BATCH, SEQ = 32, 16, 4, 8, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # one Parameter under two FQNs

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return TiedLM()


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


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
    return torch.optim.AdamW(params, lr=0.01)


split_points = ["layers.2"]
