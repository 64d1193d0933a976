"""Issue 57: a dynamic position bias, as x-transformers writes it (``dynamic_pos_bias``, ``DynamicPositionBias`` with
``log_distance`` and ``norm``): each relative distance -(n-1)..n-1 as ``sign * log(|d| + 1)``, fed through a small
MLP shared by every layer, ``Linear(1, 16) -> LayerNorm -> SiLU -> Linear(16, 16) -> LayerNorm -> SiLU ->
Linear(16, heads)``, indexed by ``i - j + n - 1`` into one bias per head added to the ``[heads, i, j]`` scores;
x-transformers' attention otherwise (4 query heads, 2 key/value heads tiled, ``einsum`` scores, no rotary), hidden
64, 2 layers, 16 tokens.

The MLP reads no input of the model: its FLOPs and the bytes of its collectives both grow with the distances only.
Sharded as a column-wise, row-wise pair with its norms written out, it all-reduced ``[2n - 1, 16]`` and its norms'
statistics forward and backward to save a few thousand FLOPs; under ``--tp 2`` it is computed whole on every rank,
and its last linear's heads are read at each rank's heads.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEADS, HEAD_DIM, Block, RMSNorm, SeparateAttention, SwiGLU, VOCAB, loss_fn, sgd, token_batch  # noqa: F401

POS_DIM = 16


class DynamicPositionBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Sequential(nn.Linear(1, POS_DIM), nn.LayerNorm(POS_DIM), nn.SiLU()),
            nn.Sequential(nn.Linear(POS_DIM, POS_DIM), nn.LayerNorm(POS_DIM), nn.SiLU()),
            nn.Linear(POS_DIM, HEADS))

    def forward(self, n):
        seq = torch.arange(-n + 1, n, dtype=torch.float32)
        seq = (torch.sign(seq) * torch.log(seq.abs() + 1)).unsqueeze(-1)  # log distance
        bias = self.mlp(seq)  # [2n - 1, heads]
        i, j = torch.arange(n), torch.arange(n)
        indices = i[:, None] - j[None, :] + n - 1
        return bias[indices].permute(2, 0, 1)  # [heads, i, j]


class BiasedAttention(SeparateAttention):
    def __init__(self):
        super().__init__(2)

    def forward(self, x, bias, _sin):  # Block passes (cos, sin): here (bias, None)
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.to_k(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2).repeat(1, HEADS // self.kv_heads, 1, 1)
        v = self.to_v(x).view(B, T, self.kv_heads, HEAD_DIM).transpose(1, 2).repeat(1, HEADS // self.kv_heads, 1, 1)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5 + bias
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class PositionBiasDecoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.rel_pos = DynamicPositionBias()
        self.h = nn.ModuleList([Block(functools.partial(RMSNorm, D), BiasedAttention, SwiGLU)
                                for _ in range(layers)])
        self.ln_f = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        bias = self.rel_pos(idx.shape[1])
        x = self.wte(idx)
        for block in self.h:
            x = block(x, bias, None)
        return self.lm_head(self.ln_f(x))


def model():
    torch.manual_seed(0)
    return PositionBiasDecoder(2)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
