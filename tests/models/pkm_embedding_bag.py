"""Issue 57: a product-key memory in place of the MLP, as lucidrains' ``product-key-memory`` computes it
(``PKM.forward``: each position's query scored against two sets of sub-keys, the top k of their products picked, and
the picked values summed by an ``nn.EmbeddingBag(num_keys ** 2, dim, mode="sum")`` with the softmaxed scores as
``per_sample_weights``, over the ``[(b n), k]`` indices: one bag per position); lit-gpt's attention otherwise, hidden
64, 4 query heads, 2 key/value heads, 2 layers, 16 tokens, 16 x 16 memory slots, top 4.

``F.embedding_bag`` flattens the 2-D indices and bags them by ``arange(0, numel, k)`` offsets. Under ``--cp 2`` each
rank's positions are whole bags: the offsets are made for this rank's indices and the bags summed on its rows. It
was refused ("embedding_bag ... mixes the positions of the sequence"). Under ``--tp 2`` the values table is
vocabulary-parallel: each rank sums the picked slots it holds (the others weighted 0) and an all-reduce adds the
ranks' sums. It was whole on every rank (0.58 of each stage; product-key memory's decoder: 0.61 of each layer).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, Decoder, RMSNorm, SeparateAttention, loss_fn, sgd, token_batch  # noqa: F401

KEYS, TOPK, KEY_DIM = 16, 4, 16


class ProductKeyMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_queries = nn.Linear(D, 2 * KEY_DIM, bias=False)
        self.keys = nn.Parameter(torch.randn(2, KEYS, KEY_DIM) / KEY_DIM ** 0.5)
        self.values = nn.EmbeddingBag(KEYS ** 2, D, mode="sum")

    def forward(self, x):
        b, t, _ = x.shape
        queries = self.to_queries(x).view(b, t, 2, KEY_DIM)
        dots = torch.einsum("b t p d, p n d -> b t p n", queries, self.keys)
        scores, indices = dots.topk(TOPK, dim=-1)  # [b, t, 2, k]
        all_scores = (scores[..., 0, :, None] + scores[..., 1, None, :]).reshape(b, t, TOPK * TOPK)
        all_indices = (indices[..., 0, :, None] * KEYS + indices[..., 1, None, :]).reshape(b, t, TOPK * TOPK)
        final_scores, picked = all_scores.topk(TOPK, dim=-1)
        value_indices = all_indices.gather(-1, picked)
        attn = final_scores.softmax(dim=-1)
        out = self.values(value_indices.reshape(b * t, TOPK), per_sample_weights=attn.reshape(b * t, TOPK))
        return out.reshape(b, t, D)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), lambda: SeparateAttention(2), ProductKeyMemory)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
