"""A Llama-style language model written by hand, for tensor parallelism: RMSNorm, rotary positions,
grouped-query attention (4 query heads, 2 key/value heads), a SwiGLU MLP and a head tied to the embedding.

``tracepp split --tp 2`` shards q/k/v and gate/up column-wise, o and down row-wise, and the tied embedding and
head over the vocabulary; training must equal eager training of this model. ``TP_LLAMA_SIZE=bench`` gives the
size ``benchmarks/tensor_parallel.py`` measures memory at (hidden 512, 8 heads, 4 kv heads, vocabulary 8192).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, KV_HEADS, HIDDEN, LAYERS, BATCH, SEQ = 64, 32, 4, 2, 64, 4, 8, 16
if os.environ.get("TP_LLAMA_SIZE") == "bench":
    VOCAB, D, HEADS, KV_HEADS, HIDDEN, LAYERS, BATCH, SEQ = 8192, 512, 8, 4, 1536, 4, 8, 64
LAYERS = int(os.environ.get("TP_LLAMA_LAYERS", LAYERS))  # the work-count tests plan 8 and 32 layers
HEAD_DIM = D // HEADS
# TP_LLAMA_SEQ=dynamic: the sequence length changes per step (a dynamic dim), 7 at step 3 (odd: a tp 2
# sequence-parallel split cannot shard it)
DYNAMIC = os.environ.get("TP_LLAMA_SEQ") == "dynamic"
SEQS = [16, 8, 12, 7]


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, D, bias=True)

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, HEADS * HEAD_DIM))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(D, HIDDEN, bias=False)
        self.up_proj = nn.Linear(D, HIDDEN, bias=True)
        self.down_proj = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = RMSNorm(D)
        self.attn = Attention()
        self.mlp_norm = RMSNorm(D)
        self.mlp = MLP()

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = RMSNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device).float()
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return Llama()


def _data(step):
    g = torch.Generator().manual_seed(200 + step)
    seq = SEQS[step % len(SEQS)] if DYNAMIC else SEQ
    return torch.randint(0, VOCAB, (BATCH, seq), generator=g), torch.randint(0, VOCAB, (BATCH, seq), generator=g)


if DYNAMIC:
    from torch.export import Dim

    dynamic_shapes = {"idx": {1: Dim("seq", min=2, max=64)}}


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
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
