"""Issue 57: x-transformers' gated values (``attn_gate_values=True``: the attention's output per head scaled by
``sigmoid(to_v_gate(x))`` in head space, before ``to_out``) with grouped-query attention, the key/value heads tiled
to the query heads by einops' ``repeat`` (``lib_style.SeparateAttention``: query head h reads key/value head
h mod kv_heads). Hidden 64, 4 query heads, 2 key/value heads, 16 tokens.

``--tp 2`` gives each rank the query heads that read its key/value heads (heads {0, 2} and {1, 3}: the query
projection in two segments); the gate's projection must hold the same heads. It held heads {0, 1} and the product
of the two was gathered, every projection of the attention kept whole (0.00 of it sharded, x-transformers' memkv
configuration in the second families table).
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEAD_DIM, HEADS, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

KV_HEADS = 2


class GatedValuesAttention(SeparateAttention):
    def __init__(self):
        super().__init__(KV_HEADS)
        self.to_v_gate = nn.Linear(D, HEADS * HEAD_DIM)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        gates = self.to_v_gate(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)  # 'b n (h d) -> b h n d'
        out = self.heads(x, cos, sin) * gates.sigmoid()
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), GatedValuesAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
