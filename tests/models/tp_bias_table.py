"""A decoder with a learned relative position bias per head, as T5 and CPM-Ant write it: an ``nn.Embedding`` of
``[buckets, heads]`` picked at the bucket of each query-key distance, permuted to ``[heads, q, k]`` and added to each
head's scores. At tp 2 the heads are split over the ranks, so the table is held by its columns (each rank its
heads' biases) and read at them with no collective; read by the vocabulary's rows, its lookup would all-reduce
``[heads, q, k]`` forward."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, FF, LAYERS, BATCH, SEQ, BUCKETS = 48, 32, 4, 64, 2, 4, 8, 6
HEAD = D // HEADS


def buckets(seq):
    position = torch.arange(seq)
    distance = (position[:, None] - position[None, :]).clamp(min=0)  # causal: how far back the key is
    return torch.where(distance < BUCKETS - 1, distance, torch.full_like(distance, BUCKETS - 1))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / HEAD ** 0.5 + bias
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, D))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x, bias):
        x = x + self.attn(self.norm1(x), bias)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.relative_attention_bias = nn.Embedding(BUCKETS, HEADS)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        bias = self.relative_attention_bias(buckets(idx.shape[1])).permute(2, 0, 1)[None]  # [1, heads, q, k]
        for layer in self.layers:
            x = layer(x, bias)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (ids[:, :-1],), {}, ids[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
