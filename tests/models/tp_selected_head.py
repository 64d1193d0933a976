"""Issue 57: one head's scores read by every head, as x-transformers' selective attention writes it
(``attend.py``, ``selective_attn``: ``gate = relu(sim[:, 0])``, shifted one query down, summed along the queries
and subtracted from every head's scores); x-transformers' attention otherwise (``KV_HEADS`` key/value heads, 2 by
default, tiled to 4 query heads; ``einsum`` scores), hidden 64, 2 layers, 16 tokens. ``HEAD`` picks the head (0).
``POS_TABLE=1`` adds CoPE's position logits, each query against a learned table of positions
(``einsum('b h i d, p d -> b h i p', q, pos_emb)``, added to the scores): a table of weights, not a key of one head.

Under ``--tp 2`` the scores are sharded by heads and ``sim[:, HEAD]`` is one rank's: that rank takes it, the others
hold zeros, and an all-reduce of ``[b, s, s]`` makes it whole on every rank (``tp_owned_select``). Gathered, the
select needed every head's scores, and the plan kept the query and key projections whole (a share of 0.50).
"""
import functools
import os

import torch
import torch.nn.functional as F
from lib_style import D, HEADS, HEAD_DIM, SEQ, Decoder, RMSNorm, SeparateAttention, SwiGLU, apply_rope, loss_fn, sgd, token_batch  # noqa: F401


KV = int(os.environ.get("KV_HEADS", "2"))
HEAD = int(os.environ.get("HEAD", "0"))
POS_TABLE = os.environ.get("POS_TABLE") == "1"


class SelectiveAttention(SeparateAttention):
    def __init__(self):
        super().__init__(KV)
        if POS_TABLE:
            self.pos_emb = torch.nn.Parameter(torch.randn(SEQ, HEAD_DIM) * 0.02)

    def heads(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = self.to_v(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        r = HEADS // self.kv_heads
        k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5
        if POS_TABLE:
            sim = sim + torch.einsum("b h i d, p d -> b h i p", q, self.pos_emb)
        gate = F.relu(sim[:, HEAD])  # one head's scores gate every head's
        gate = (1.0 - torch.eye(T, device=x.device)) * gate
        gate = F.pad(gate, (0, 0, 1, -1), value=0.0).cumsum(dim=-2)  # only the future is masked
        sim = sim - gate.unsqueeze(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), SelectiveAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
