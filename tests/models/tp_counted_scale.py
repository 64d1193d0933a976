"""An MLP scaled by a buffer the forward counts up in place (``self.calls.add_(1)``, as a router counts the tokens it
sends to each expert): tp 2 shards the MLP, and the verification must give every tp rank the buffer as it was
before the unsharded reference run wrote into it, or the ranks compute with the next step's count and a correct
plan looks wrong."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, BATCH, SEQ = 32, 16, 32, 4, 8


class CountedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)
        self.register_buffer("calls", torch.ones(HIDDEN))

    def forward(self, x):
        self.calls.add_(1)
        return x + self.down(F.gelu(self.up(x)) / self.calls)


class CountedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([CountedMLP() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return CountedLM()


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]
