"""Frozen parameters next to a tied embedding/head, trained with a stateful optimizer (AdamW).

`layers.0` and the final norm are frozen (requires_grad=False): no rank may give them a gradient or optimizer
state, and they must come out of training unchanged. The embedding is tied to the head across ranks: AdamW's
moments of each copy must see the same summed gradient, or the copies drift apart.
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


class FrozenTiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.layers[0].requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return FrozenTiedLM()


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
    return torch.optim.AdamW(params, lr=0.01, betas=(0.8, 0.9), weight_decay=0.05)
