"""Per-head tables and experts written as 3-D weights, for tensor parallelism, as Inkling writes them: a relative
position bias per head, ``(states [b, s, heads, r] @ bank [r, extent])`` (a linear over rows sharded on their heads,
not their features), picked by distance with ``gather`` along the last dim and masked with ``where(cond, x, -inf)``;
a short convolution over time written as ``F.pad``, ``unfold`` and ``flip`` with static taps ``[k, channels]`` read
as ``taps.T.view(heads, d, k)``; a shared expert as 3-D weights, ``bmm(x, W.transpose(1, 2))``. Each rank computes
its heads with its own rows of every table.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, HEADS, REL, EXTENT, TAPS, BATCH, SEQ = 32, 32, 4, 4, 6, 3, 4, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.r = nn.Linear(D, HEADS * REL, bias=False)
        self.bank = nn.Parameter(torch.randn(REL, EXTENT) * 0.3)
        self.taps = nn.Parameter(torch.randn(TAPS, D) * 0.3)
        self.gate = nn.Parameter(torch.randn(1, 2 * D, D) * 0.1)
        self.up = nn.Parameter(torch.randn(1, 2 * D, D) * 0.1)
        self.down = nn.Parameter(torch.randn(1, D, 2 * D) * 0.1)

    def forward(self, x):
        b, s, _ = x.shape
        context = F.pad(self.v(x).transpose(1, 2), (TAPS - 1, 0))  # [b, channels, s + taps - 1]
        windows = context.unfold(-1, TAPS, 1).flip(-1).transpose(1, 2).reshape(b, s, HEADS, D // HEADS, TAPS)
        v = (windows * self.taps.float().T.view(HEADS, D // HEADS, TAPS)).sum(-1).reshape(b, s, D)
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in (self.q(x), self.k(x), v))
        logits = (self.r(x).view(b, s, HEADS, REL) @ self.bank).transpose(1, 2)  # [b, heads, s, extent]
        position = torch.arange(s)
        distance = (position[:, None] - position[None, :])[None, None]
        bias = logits.gather(-1, distance.clamp(0, EXTENT - 1).expand(b, HEADS, -1, -1))
        bias = torch.where(distance >= 0, bias, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        h = x + self.o(out.transpose(1, 2).reshape(b, s, D))
        flat = h.reshape(1, -1, D)
        hidden = F.silu(torch.bmm(flat, self.gate.transpose(1, 2))) * torch.bmm(flat, self.up.transpose(1, 2))
        return h + torch.bmm(hidden, self.down.transpose(1, 2)).sum(0).view(b, s, D)


model = model_of(VOCAB, D, Block)
batch = token_batch(VOCAB, BATCH, SEQ, 1600)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
