"""A residual-MLP LM whose embedding row for token 31 is NaN, and only step 1's sample 5 contains that token.

With 8 samples in 4 microbatches, sample 5 is in microbatch 2: the first non-finite value is stage 0's
output (the embedding lives there), at step 2 (1-based) and microbatch 2; steps 1 and 3 are finite.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, BATCH, SEQ = 32, 16, 4, 8, 6
NAN_TOKEN, NAN_STEP, NAN_SAMPLE = 31, 1, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.embed.weight[NAN_TOKEN] = float("nan")
    return net


def _data(step):
    g = torch.Generator().manual_seed(step + 7)
    idx = torch.randint(0, NAN_TOKEN, (BATCH, SEQ), generator=g)
    if step == NAN_STEP:
        idx[NAN_SAMPLE, 0] = NAN_TOKEN
    return idx, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


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


split_points = ["layers.2"]
