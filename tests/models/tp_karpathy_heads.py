"""Multi-head attention as a ``ModuleList`` of single heads, as Karpathy's "Let's build GPT" writes it (``gpt.py`` of
ng-video-lecture: ``Head`` with its own ``key``, ``query`` and ``value`` linears, ``MultiHeadAttention`` joining the
heads with ``torch.cat`` before ``proj``; ``Block``, ``FeedFoward`` and ``GPTLanguageModel`` as there), at a context of
``BLOCK`` tokens (64; the lecture's 256) and 4 heads of 8.

No dim holds the heads: tensor parallelism shards each head's features, and a head's scores ``q @ k.T`` are partial
sums over them. All-reduced, ``[b, t, t]`` per head moves more than the heads' ``q`` and ``k``: from a context of
about twice a head's width on, each head's q and k are computed whole instead (``tp_walk._gathered_cheaper``).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, N_EMBD, N_HEAD, N_LAYER, BATCH = 32, 32, 4, 2, 4
BLOCK = int(os.environ.get("BLOCK", "64"))
HEAD_SIZE = N_EMBD // N_HEAD


class Head(nn.Module):
    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(N_EMBD, head_size, bias=False)
        self.query = nn.Linear(N_EMBD, head_size, bias=False)
        self.value = nn.Linear(N_EMBD, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(BLOCK, BLOCK)))

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        v = self.value(x)
        return wei @ v


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, N_EMBD)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        return self.proj(out)


class FeedFoward(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.sa = MultiHeadAttention(n_head, n_embd // n_head)
        self.ffwd = FeedFoward(n_embd)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        x = x + self.ffwd(self.ln2(x))
        return x


class GPTLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_embedding_table = nn.Embedding(VOCAB, N_EMBD)
        self.position_embedding_table = nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.Sequential(*[Block(N_EMBD, n_head=N_HEAD) for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx):
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))
        x = tok_emb + pos_emb
        x = self.blocks(x)
        x = self.ln_f(x)
        return self.lm_head(x)


def model():
    torch.manual_seed(0)
    return GPTLanguageModel()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
