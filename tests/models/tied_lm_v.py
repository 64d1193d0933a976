"""A tiny language model whose LM head reuses the embedding matrix (tied weights), for V-placement tests.

Split at layers.1, layers.2, layers.3 it makes 4 stages: stage 0 (embed, layers.0) and stage 3 (layers.3,
head) both read ``embed.weight``. Under V placement on 2 ranks both sit on rank 0, so one tensor serves two
stages on one rank. BATCH is 12 so that 2, 3, 4 and 6 microbatches all divide it.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, BATCH, SEQ = 24, 12, 4, 12, 5


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
        self.head.weight = self.embed.weight  # tied: one parameter, two names

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return TiedLM()


def _data(step):
    g = torch.Generator().manual_seed(step + 11)
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
    return torch.optim.SGD(params, lr=0.2)


split_points = ["layers.1", "layers.2", "layers.3"]
