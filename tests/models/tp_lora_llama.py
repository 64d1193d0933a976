"""A Llama-style decoder fine-tuned with LoRA, written as torchtune's ``LoRALinear`` and litgpt's LoRA layers write it:
every projection (q, k, v, o, gate, up, down) keeps its pretrained weight frozen and adds a trained low-rank pair,
``F.linear(x, W) + lora_b(lora_a(x)) * (alpha / rank)``; the embedding, norms and head frozen too. The adapters are
under 1% of a layer's parameters (hidden 256, rank 4), as in a real fine-tune.

Under ``--tp 2`` PEFT's tensor-parallel LoRA (``LoraParallelLinear`` for Megatron) is the reference: beside a
column-wise base ``lora_a`` whole and ``lora_b`` column-wise, beside a row-wise one ``lora_a`` row-wise and ``lora_b``
whole: Megatron's two all-reduces of ``[b, s, h]`` each way plus one all-reduce of each adapter's ``[b, s, rank]``.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

ADALORA = os.environ.get("ADALORA") == "1"  # PEFT's AdaLoRA: x @ (lora_A * lora_E).T @ lora_B.T, an SVD triplet

VOCAB, D, HEADS, KV_HEADS, FF, RANK, ALPHA, LAYERS, BATCH, SEQ = 128, 256, 8, 4, 688, 4, 8, 2, 4, 8
HEAD_DIM = D // HEADS
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, in_dim, out_dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim) / in_dim ** 0.5, requires_grad=False)
        self.lora_a = nn.Linear(in_dim, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, out_dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # (zeros in a fresh fine-tune: nonzero so every weight trains)
        self.scaling = ALPHA / RANK
        if ADALORA:
            self.lora_E = nn.Parameter(0.1 * torch.randn(RANK, 1))

    def forward(self, x):
        if ADALORA:  # adalora/layer.py: result += (x @ (lora_A * lora_E).T @ lora_B.T) * scaling
            return F.linear(x, self.weight) + (x @ (self.lora_a.weight * self.lora_E).T
                                               @ self.lora_b.weight.T) * self.scaling
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim), requires_grad=False), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(D), RMSNorm(D)
        self.q_proj = LoRALinear(D, HEADS * HEAD_DIM)
        self.k_proj, self.v_proj = LoRALinear(D, KV_HEADS * HEAD_DIM), LoRALinear(D, KV_HEADS * HEAD_DIM)
        self.o_proj = LoRALinear(HEADS * HEAD_DIM, D)
        self.gate_proj, self.up_proj, self.down_proj = LoRALinear(D, FF), LoRALinear(D, FF), LoRALinear(FF, D)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (p(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(2100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (ids[:, :-1],), {}, ids[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
