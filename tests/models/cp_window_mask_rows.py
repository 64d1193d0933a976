"""Issue 57: attention as litgpt 0.5 writes it for its sliding-window configs (Mistral, Phi-3, Gemma 2 and 3:
``litgpt/model.py``, ``CausalSelfAttention``). The window's mask is a ``torch.full((T, T), -inf)`` whose rows are
opened one by one in a Python loop (``mask[i, start:i + 1] = 0``: in place, through a select and a slice of the
factory), then viewed ``[1, 1, T, T]`` and added to the causal mask; with ``SOFTCAP`` the scores are spelled out as
Gemma 2 spells them, ``q @ k.mT * scale``, capped by ``tanh``, masked, softmax and ``@ v`` (``mT``: no rule before,
refused under cp as "mixes the positions of the sequence"); else ``F.scaled_dot_product_attention`` with the mask.
Hidden 64, 4 heads, 2 key/value heads, 16 tokens, a window of 4.

``--cp 2`` must cut the finished mask to this rank's query rows: the cut had been moved up to the factory, made for
this rank's rows, while the loop's writes went into the whole one (every score masked; caught by the verification).
Its loss casts the logits to fp32 as litgpt's does (export checks the traced device there).
"""
import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEAD_DIM, HEADS, RMSNorm, SwiGLU, Decoder, apply_rope, sgd, token_batch  # noqa: F401

KV_HEADS, WINDOW = 2, 4
SOFTCAP = float(os.environ.get("SOFTCAP", "0"))


class WindowAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(D, KV_HEADS * HEAD_DIM, bias=False)
        self.proj = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        mask = torch.ones(T, T, dtype=x.dtype, device=x.device).triu(diagonal=1)
        mask.masked_fill_(mask.bool(), float("-inf"))
        window = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device)
        for i in range(T):
            window[i, max(0, i - WINDOW + 1):i + 1] = 0.0
        mask = mask.view(1, 1, T, T) + window.view(1, 1, T, T)
        scale = 1.0 / math.sqrt(HEAD_DIM)
        if SOFTCAP:
            scores = q @ k.mT * scale
            scores = torch.tanh(scores / SOFTCAP) * SOFTCAP + mask
            y = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float).to(q.dtype) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), WindowAttention, SwiGLU)


def loss_fn(logits, target):  # as litgpt's trainers take it: the logits cast to fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
