"""PaLM's parallel block as lucidrains' PaLM-pytorch writes it (``palm_pytorch.py``: ``ParallelTransformerBlock``):
one ``fused_attn_ff_proj`` whose output is split into the queries, one key head and one value head (multi-query
attention), and the MLP's input; the MLP half chunked into its two halves by SwiGLU; attention as ``einsum``;
``attn_out(out) + ff_out(ff)`` added to the residual. 2 layers, hidden 64, 4 query heads of 16, 16 tokens.

``--tp 2`` must shard the queries' and the MLP's features of the fused projection (the MLP part learned as two
segments, so that each rank's chunk holds its piece of each half; it was replicated: "cuts 256 sharded features at
[128], inside the pieces"), and the rewrite must give the attention the gathered value head where it also reads
it beside the heads' pieces (the copy of the gathered value: before, the copy read the value's piece and the
verification repaired the plan down to 10% of the parameters).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEAD_DIM, HEADS, VOCAB, loss_fn, sgd, token_batch  # noqa: F401

FF_INNER = 4 * D


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class ParallelTransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fused_dims = (HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM, 2 * FF_INNER)
        self.fused_attn_ff_proj = nn.Linear(D, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)
        self.ff_out = nn.Sequential(SwiGLU(), nn.Linear(FF_INNER, D, bias=False))

    def forward(self, x):
        b, n, _ = x.shape
        x = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)
        q = q.view(b, n, HEADS, HEAD_DIM).transpose(1, 2) * HEAD_DIM ** -0.5
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k)
        causal = torch.ones((n, n), dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM)
        return self.attn_out(out) + self.ff_out(ff)


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, D), *[Residual(ParallelTransformerBlock()) for _ in range(2)],
                         nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False))


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
