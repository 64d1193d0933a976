"""Attention-like heads written into a buffer in place, for tensor parallelism: ``torch.zeros_like`` of the
column-parallel heads, then the first position of every head overwritten by a running sum over the heads (whole
on every rank: it mixes the heads), the way the reference scans of linear-attention families (Kimi Linear) fill
their outputs. The write cannot go into a shard, and a gather would take it into a copy and lose it: the buffer
must be whole from where it is made.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, BATCH, SEQ = 32, 16, 4, 4, 8


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D)
        self.o = nn.Linear(D, D)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.q(x).view(b, s, HEADS, D // HEADS).transpose(1, 2)  # [b, heads, s, d]: heads sharded
        out = torch.zeros_like(h)
        every = h.cumsum(1)  # each head's running sum over the heads up to it: whole (a scan across the heads; a sum
        #                      over them expanded back, h.sum(1, keepdim=True).expand_as(h), is each rank's heads)
        out[:, :, 0] = torch.tanh(every[:, :, 0])  # copy_ into a select of the buffer
        out = out + h
        return x + self.o(out.transpose(1, 2).reshape(b, s, D))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.mixer = Mixer()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        return self.head(self.mixer(self.embed(idx)))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(700 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
