"""tied_lm.py's model trained with AdamW, parameter groups chosen by FQN and an LR schedule from the model file.

The tied embedding/head weight lives on both stages of a 2-way split: both ranks must apply the same AdamW
update to it. Norm weights and biases get no weight decay (chosen by name, through ``named_params``).
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


def _no_decay(name):
    return name.endswith(".bias") or name.startswith("norm.") or ".norm." in name


def optimizer(named_params):
    decay = [p for name, p in named_params if not _no_decay(name)]
    no_decay = [p for name, p in named_params if _no_decay(name)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=0.02, betas=(0.9, 0.95))


def lr_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2) * 0.9 ** step)


split_points = ["layers.2"]
