"""DeepSeek-style multi-head latent attention (MLA) in a decoder whose MLP is wide, as at real size: each layer's
low-rank down-projections (``q_a_proj`` 64 -> 16, ``kv_a_proj_with_mqa`` 64 -> 16 + 8) hold about 2% of its
parameters. The query and key/value latents are normalised (a mean of squares), widened into 4 heads by
``q_b_proj`` / ``kv_b_proj``, and the rotary part of the keys (``k_pe``, one head) is shared by every head.
``MLA_Q_LORA=0``: the queries projected at full rank (``q_proj`` 64 -> 4 heads, DeepSeek-V2-Lite's and Kimi Linear's
MLA), the key/value latent alone low-rank.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, NOPE, ROPE, V, Q_RANK, KV_RANK, FF, BATCH, SEQ = 64, 64, 4, 16, 8, 16, 16, 16, 640, 4, 8
Q_LORA = os.environ.get("MLA_Q_LORA", "1") != "0"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        if Q_LORA:
            self.q_a_proj = nn.Linear(D, Q_RANK, bias=False)
            self.q_a_layernorm = RMSNorm(Q_RANK)
            self.q_b_proj = nn.Linear(Q_RANK, HEADS * (NOPE + ROPE), bias=False)
        else:
            self.q_proj = nn.Linear(D, HEADS * (NOPE + ROPE), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, KV_RANK + ROPE, bias=False)
        self.kv_a_layernorm = RMSNorm(KV_RANK)
        self.kv_b_proj = nn.Linear(KV_RANK, HEADS * (NOPE + V), bias=False)
        self.o_proj = nn.Linear(HEADS * V, D, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if Q_LORA else self.q_proj(x)
        q = q.view(b, s, HEADS, NOPE + ROPE).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        compressed, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [KV_RANK, ROPE], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(b, s, HEADS, NOPE + V).transpose(1, 2)
        k_nope, value = torch.split(kv, [NOPE, V], dim=-1)
        k_pe = rotate(k_pe.view(b, 1, s, ROPE), cos, sin)
        q_pe = rotate(q_pe, cos, sin)
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(b, HEADS, s, ROPE)), dim=-1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, HEADS * V))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down_proj = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(D), RMSNorm(D)
        self.self_attn, self.mlp = Attention(), MLP()

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer() for _ in range(2)])
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
        angles = torch.outer(torch.arange(SEQ).float(), inv)
        self.register_buffer("cos", torch.cat((angles, angles), dim=-1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), dim=-1).sin(), persistent=False)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(1700 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
