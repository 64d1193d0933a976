"""Issue 57: attention of several branches over the same heads, their outputs stacked and weighed per head, as
native-sparse-attention-pytorch writes it (``native_sparse_attention.py``, ``SparseAttention.forward``): one fused
``to_qkv``, 2 key/value heads tiled to 4 query heads, a full causal branch (``repeat_interleave``) and a
sliding-window branch (einops' ``repeat``: an expand and a reshape; the heads packed into the batch by a ``cat`` of one part
as local-attention's ``LocalAttention`` packs them), then ``einsum('b h n s, s b h n d -> b h n d', gates, stack([...]))`` with the gates from
``to_strategy_combine`` (a linear, a sigmoid, ``'b n (h s) -> b h n s'``) and ``combine_heads`` after the heads are
merged; 2 layers, hidden 64, 16 tokens.

Megatron's plan applies: ``to_qkv`` and ``to_strategy_combine`` column-wise by heads, ``combine_heads`` row-wise. The
stack of the branches holds each rank's heads (``tp_walk._stack``). It had no tp rule of its own, and torch's
refused parts whose segments differed (the packing ``cat`` of one part gave its output one segment as wide as the
dim, the other branches none): the stack was computed whole and ``to_qkv`` replicated.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEAD_DIM, HEADS, Decoder, RMSNorm, SwiGLU, apply_rope, loss_fn, sgd, token_batch

KV_HEADS, WINDOW, BRANCHES = 2, 4, 2


class BranchedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_split = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
        self.to_qkv = nn.Linear(D, sum(self.qkv_split), bias=False)
        self.to_strategy_combine = nn.Linear(D, BRANCHES * HEADS)
        self.combine_heads = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).split(self.qkv_split, dim=-1)
        q, k, v = (t.view(b, n, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        full = F.scaled_dot_product_attention(q, *(t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v)),
                                              is_causal=True)
        # the sliding window's keys tiled as einops' repeat(t, 'b h ... -> b (h g) ...') writes it
        k, v = (t[:, :, None].expand(b, KV_HEADS, HEADS // KV_HEADS, n, HEAD_DIM).reshape(b, HEADS, n, HEAD_DIM)
                for t in (k, v))
        i = torch.arange(n, device=x.device)
        window = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW)
        # local-attention's LocalAttention packs the heads into the batch (einops' pack([t], '* n d'): a cat of one
        # part) and unpacks its output
        local = F.scaled_dot_product_attention(*(torch.cat([t.reshape(b * HEADS, n, HEAD_DIM)]) for t in (q, k, v)),
                                               attn_mask=window).reshape(b, HEADS, n, HEAD_DIM)
        gates = self.to_strategy_combine(x).sigmoid().view(b, n, HEADS, BRANCHES).permute(0, 2, 1, 3)
        out = torch.einsum("bhns,sbhnd->bhnd", gates, torch.stack([full, local]))
        return self.combine_heads(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), BranchedAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
