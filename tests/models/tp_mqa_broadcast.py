"""Multi-query attention with its one key/value head broadcast to the query heads, as Falcon-7B (transformers'
``FalconAttention``: ``scaled_dot_product_attention`` of ``[b, heads, s, d]`` queries and ``[b, 1, s, d]`` keys) and
recurrentgemma's Griffin (``einsum("b t n h, b s n h -> b n t s")`` with ``n`` 1 for the key; ``MQA_EINSUM=1``) and
x-transformers' ``attn_one_kv_head`` (``einsum("b h i d, b j d -> b h i j")``: a key with no heads dim at all;
``MQA_EINSUM=2``) write it; lit-gpt's decoder otherwise, hidden 64, 4 heads, 16 tokens, 2 layers.

Megatron-Core divides the key/value groups among the tp ranks and refuses fewer groups than tp: ``inspect`` prints
no Megatron figure for these layers (it compared Falcon's with a plan that does not exist: 0.50x).

``IDS_CAST=1`` feeds int32 token ids the model casts before the embedding, as x-transformers' ``TokenEmbedding``
does (``self.emb(x.long())``), with no rotary positions, as x-transformers' model of one key/value head: the cast
ids were taken for indices the model computes (positions), the embedding for a table every rank holds whole, and
the first layer's key, made from it, for no key of one head (a Megatron figure printed for that layer only).
"""
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import (D, HEADS, HEAD_DIM, Decoder, RMSNorm, SwiGLU, apply_rope, loss_fn, sgd,  # noqa: F401
                       token_batch)

EINSUM = os.environ.get("MQA_EINSUM", "0")
IDS_CAST = os.environ.get("IDS_CAST") == "1"


class MultiQueryAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.to_k = nn.Linear(D, HEAD_DIM, bias=False)
        self.to_v = nn.Linear(D, HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, 1, HEAD_DIM).transpose(1, 2)
        v = self.to_v(x).view(B, T, 1, HEAD_DIM).transpose(1, 2)
        if not IDS_CAST:  # x-transformers' model of one key/value head has no rotary positions
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        if EINSUM == "1":
            sim = torch.einsum("b n t h, b m s h -> b n t s", q, k.expand(B, 1, T, HEAD_DIM)) * HEAD_DIM ** -0.5
            attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
            out = torch.einsum("b n t s, b m s h -> b n t h", attn, v)
        elif EINSUM == "2":
            k, v = k.squeeze(1), v.squeeze(1)  # [b, s, d]: one head, no heads dim
            sim = torch.einsum("b h i d, b j d -> b h i j", q, k) * HEAD_DIM ** -0.5
            attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
            out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class CastIdsDecoder(Decoder):
    def forward(self, idx):
        return super().forward(idx.long())


def model():
    torch.manual_seed(0)
    return (CastIdsDecoder if IDS_CAST else Decoder)(2, functools.partial(RMSNorm, D), MultiQueryAttention, SwiGLU)


def batch(step):
    (ids,), kwargs, target = token_batch(step)
    return ((ids.int() if IDS_CAST else ids),), kwargs, target  # int32 ids, cast to int64 by the model


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
