"""A decoder whose attention adds a relative position bias computed from the hidden states, as ProphetNet's does: a
linear makes ``[b, s, buckets * heads]``, viewed per head and picked at each query-key distance's bucket by
``gather``, then added to each head's scores. At tp 2 the heads are split over the ranks and the bias is read at
each rank's heads; computed whole, its gradient on each rank is that rank's heads' part. The parts are carried back
through the gather, the linear and a split of the hidden states (``chunk``) to the attention's input, whose
gradient is summed over tp anyway: the bias costs no collective (its pieces were all-gathered per layer, ``[b,
heads, s, s]``), and the linear's weight takes parts, summed once per step."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, FF, LAYERS, BATCH, SEQ, BUCKETS = 48, 32, 4, 64, 2, 4, 8, 6
HEAD = D // HEADS


def buckets(seq):
    position = torch.arange(seq)
    distance = (position[:, None] - position[None, :]).clamp(min=0)
    return distance.clamp(max=BUCKETS - 1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D, bias=False)
        self.rel = nn.Linear(D, BUCKETS * HEADS)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (proj(h).view(b, s, HEADS, HEAD).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / HEAD ** 0.5
        left, right = h.chunk(2, dim=-1)  # the bias reads the states with their halves swapped
        table = self.rel(torch.cat([right, left], dim=-1)).view(b, s, BUCKETS, HEADS).permute(0, 3, 1, 2)
        index = buckets(s)[None, None].expand(b, HEADS, s, s)
        scores = scores + torch.gather(table, 3, index)  # [b, heads, q, k]
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

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(1100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (ids[:, :-1],), {}, ids[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)
