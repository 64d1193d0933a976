"""A frequency cache written into a buffer on the first call and read by every later one, as rotary-embedding-torch
writes it (``RotaryEmbedding.forward`` with ``cache_if_possible``: ``self.cached_freqs[:seq_len] = freqs.detach()``
into a non-persistent buffer of zeros, then ``self.cached_freqs[offset:offset + seq_len]`` while it is long enough;
nGPT-pytorch shares one such module between all its layers). Layer 0 (stage 0) makes the frequencies and writes
them; layer 1 (stage 1, after the ``pipe_split()``) reads the buffer. Each stage holds its own copy of a buffer:
stage 1's was never written, its frequencies all zeros, and the split trained to other parameters than eager's
with no warning.

``READ_BEFORE=1``: layer 0 reads the buffer before any layer writes it and layer 1 makes the frequencies, so the
write is on stage 1 and the read, on the next step, would need stage 1's value on stage 0: refused by name.
``KEEP_ACTIVATIONS=1``: layer 0's output, which carries a gradient, is written into the buffer (a key/value cache
kept in training): the next microbatch's backward would run through this one's graph; refused by name.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from tracepp import pipe_split

D, SEQ, BATCH, MAX_SEQ = 16, 8, 4, 32
READ_BEFORE = os.environ.get("READ_BEFORE") == "1"
KEEP_ACTIVATIONS = os.environ.get("KEEP_ACTIVATIONS") in ("1", "cast")  # a cache of activations that carry a gradient
CAST = os.environ.get("KEEP_ACTIVATIONS") == "cast"  # written through a cast that changes nothing (llama-models'
#                                                       self.cache_k = self.cache_k.to(xq))


def rotate_half(x):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class CachedRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
        self.register_buffer("cached_freqs", torch.zeros(MAX_SEQ, D), persistent=False)
        self.cached_freqs_seq_len = 0

    def forward(self, seq_len):
        if self.cached_freqs_seq_len >= seq_len:
            return self.cached_freqs[:seq_len].detach()
        freqs = torch.einsum("i,j->ij", torch.arange(seq_len, dtype=self.freqs.dtype), self.freqs)
        freqs = freqs.repeat_interleave(2, dim=-1)
        self.cached_freqs[:seq_len] = freqs.detach()
        self.cached_freqs_seq_len = seq_len
        return freqs


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x, freqs):
        x = x * freqs.cos() + rotate_half(x) * freqs.sin()
        return x + torch.tanh(self.proj(x))


class CachedRotaryNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.rotary = CachedRotary()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.out = nn.Linear(D, D)

    def forward(self, x):
        seq = x.shape[1]
        h = self.inp(x)
        if READ_BEFORE:  # the buffer as it stands, before any layer writes it
            h = self.layers[0](h, self.rotary.cached_freqs[:seq] + 0.5)
        else:
            h = self.layers[0](h, self.rotary(seq))
        if KEEP_ACTIVATIONS:  # Meta's reference Llama: self.cache_k[:bsz, ...] = xk, with xk's graph
            cache = self.rotary.cached_freqs.to(h) if CAST else self.rotary.cached_freqs
            cache[:seq] = h[0]
        pipe_split()
        h = self.layers[1](h, self.rotary(seq))
        return self.out(h)


def model():
    torch.manual_seed(0)
    return CachedRotaryNet()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, SEQ, D, generator=g),), {}, torch.randn(BATCH, SEQ, D, generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    return F.mse_loss(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
