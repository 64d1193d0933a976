"""Issue 57: a mixture of experts computed one expert at a time, as litgpt's ``LLaMAMoE`` (``litgpt/model.py``),
Mistral's reference MoE and transformers' Mixtral before grouped matmuls write it: a router ``gate``, ``topk`` and a
softmax over the chosen, then a Python loop over a ``ModuleList`` of SwiGLU experts, each run on the rows
``torch.where(mask)`` picks and added back, ``y[token_idx] += probs[token_idx, expert_idx, None] *
expert(x[token_idx])`` (``index``, ``index_put_``). Hidden 64, 4 heads, 2 key/value heads, 4 experts of 128 top-2.

``--tp 2`` shards every expert column-wise then row-wise. Each expert's partial sums are carried through the loop
(a sum of zeros, rows picked and written at whole indices, scaled by the router's weights, whose gradient each rank
then holds a part of) and all-reduced once, as ``[tokens, h]``: Megatron's plan. Summed where each expert made them,
the experts' rows were all-reduced apart: ``top_k`` times the tokens. ``--cp 2`` runs the loop on each rank's
tokens (refused before: "where mixes the positions of the sequence").
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

KV_HEADS, EXPERTS, TOP_K = 2, 4, 2


class LoopMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(EXPERTS))

    def forward(self, x):
        B, T, C = x.shape
        x = x.view(-1, C)
        probs, indices = torch.topk(self.gate(x), TOP_K)
        probs = torch.softmax(probs, dim=1, dtype=torch.float).to(x.dtype)
        masks = indices.unsqueeze(-1) == torch.arange(EXPERTS, device=x.device)
        masks = masks.permute(2, 0, 1)
        y = torch.zeros_like(x)
        for mask, expert in zip(masks, self.experts):
            token_idx, expert_idx = torch.where(mask)
            y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])
        return y.view(B, T, C)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(SeparateAttention, KV_HEADS), LoopMoE)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
