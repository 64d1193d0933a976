"""Attention whose value heads are made of two projections, as ZAYA writes it: ``cat([v_now(x), v_prev(x)
shifted one token], -1).view(b, s, kv_heads, d)``. At tp 2 each projection is column-wise, so each rank holds a
piece of every value head's features (sharded on the head dim, not on the heads): the attention gathers the value
and reads it at this rank's heads, while the queries and keys stay on their heads and the output projection is
row-wise. In the first block nothing else reads the value projections, so the next pass keeps them whole; in the
second a row-wise gate per token reads ``v_now`` too, so they stay column-wise and the value is gathered, then cut to
this rank's heads, at the attention on every step.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, KV_HEADS, BATCH, SEQ = 32, 32, 4, 2, 4, 8
HEAD = D // HEADS


def repeat_kv(t, groups):
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


class Attention(nn.Module):
    def __init__(self, side: bool):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, KV_HEADS * HEAD, bias=False)
        self.v_now = nn.Linear(D, KV_HEADS * HEAD // 2, bias=False)
        self.v_prev = nn.Linear(D, KV_HEADS * HEAD // 2, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.gate = nn.Linear(KV_HEADS * HEAD // 2, 1) if side else None

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD).transpose(1, 2)
        k = self.k(x).view(b, s, KV_HEADS, HEAD).transpose(1, 2)
        now, prev = self.v_now(x), self.v_prev(x)
        prev = torch.cat([self.v_prev(x.new_zeros(b, 1, D)), prev[:, :-1]], dim=1)  # the token before
        v = torch.cat([now, prev], dim=-1).view(b, s, KV_HEADS, HEAD).transpose(1, 2)
        groups = HEADS // KV_HEADS
        out = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True)
        out = x + self.o(out.transpose(1, 2).reshape(b, s, D))
        if self.gate is not None:  # a gate per token read from the current value
            out = out * torch.sigmoid(self.gate(now))
        return out


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Attention(side=False), Attention(side=True)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(1200 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
