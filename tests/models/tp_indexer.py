"""A sparse-attention indexer for tensor parallelism, as DeepSeek-V3.2 writes one, its scores made differentiable:
a low-rank query (``q_a`` 32 -> 16, a norm, then read by two up-projections: the indexer's ``wq`` of 16 -> 16,
which does not widen, and the attention's ``q_b`` of 16 -> 32) into heads, one key head for the indexer (``wk`` and a
LayerNorm: whole), the heads' scores against it ``relu(q @ k^T)`` and their weighted sum over the heads,
``softmax(w) [.., 1, H] @ scores [.., H, T]``: a contraction over the sharded heads whose weights are whole and
carry a gradient. The sum biases the attention's scores; the attention shards its heads and ends row-wise.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, RANK, HEADS, INDEX_HEADS, INDEX_DIM, BATCH, SEQ = 32, 32, 16, 4, 4, 4, 4, 8


class RMSNorm(nn.Module):  # as Hugging Face models write it
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_a, self.q_norm = nn.Linear(D, RANK, bias=False), RMSNorm(RANK)
        self.q_b, self.wq = nn.Linear(RANK, D, bias=False), nn.Linear(RANK, INDEX_HEADS * INDEX_DIM, bias=False)
        self.wk, self.k_norm = nn.Linear(D, INDEX_DIM, bias=False), nn.LayerNorm(INDEX_DIM)
        self.weights = nn.Linear(D, INDEX_HEADS, bias=False)
        self.kv, self.o = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        latent = self.q_norm(self.q_a(x))
        iq = self.wq(latent).view(b, s, INDEX_HEADS, INDEX_DIM)
        ik = self.k_norm(self.wk(x))  # one key head: [b, s, dim]
        scores = F.relu(iq @ ik.transpose(-1, -2).unsqueeze(1))  # [b, s, heads, s]
        w = torch.softmax(self.weights(x), dim=-1)  # over the heads: whole
        index = (w.unsqueeze(-2) @ scores).squeeze(-2)  # [b, s, s]: summed over the heads
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        bias = index.masked_fill(~causal, float("-inf")).unsqueeze(1)  # [b, 1, s, s]
        q = self.q_b(latent).view(b, s, HEADS, -1).transpose(1, 2)
        k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.o(out.transpose(1, 2).reshape(b, s, D))


model = model_of(VOCAB, D, Attention)
batch = token_batch(VOCAB, BATCH, SEQ, 1500)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
