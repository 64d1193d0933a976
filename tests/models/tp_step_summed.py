"""A decoder whose attention normalises each head's queries and keys with a weight shared by the heads (Qwen3's and
Gemma 3's q/k norms, written as those files write them), and scales its queries by a learned temperature that it
also applies to the residual stream. At tp 2 the heads are split over the ranks: each rank's q/k norm weights get
a part of their gradient (summed over tp once per step, not per microbatch: ``split/tp_grads.py``); the
temperature's gradient comes also from the whole residual, the same on every rank, so it is summed per microbatch
by its copy where the heads read it and never again."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, FF, LAYERS, BATCH, SEQ = 48, 32, 4, 64, 2, 4, 8
HEAD = D // HEADS


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.q_norm = RMSNorm(HEAD)  # over each head's features: one weight for every head
        self.k_norm = RMSNorm(HEAD)
        self.temperature = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, HEADS, HEAD)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, HEADS, HEAD)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, HEADS, HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q * self.temperature, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, D)), self.temperature


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(D), RMSNorm(D)
        self.attn = Attention()
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        y, temperature = self.attn(self.norm1(x))
        x = x * temperature + y  # the temperature read whole as well
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = RMSNorm(D)
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
    g = torch.Generator().manual_seed(500 + step)
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
