"""XLM's attention as transformers writes it without a cache object passed in: the keys and values joined after an
empty cache along the sequence dim (``torch.cat([cache, k], dim=-2)``, the cache a 1-D empty tensor that
``torch.cat`` skips), scores as ``q @ k.T`` with a causal mask, softmax, ``probs @ v``; LayerNorm, a SwiGLU MLP;
2 layers, hidden 64, 4 heads, 16 tokens.

``--cp 2`` must read the join as the keys themselves (before, the plan crashed with an ``IndexError`` on the empty
part; ``--tp 2`` already skipped it): the keys and values gathered over the sequence, the mask cut to this rank's
query rows.
"""
import torch
import torch.nn as nn
from lib_style import D, HEAD_DIM, HEADS, Decoder, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class CachedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_lin, self.k_lin, self.v_lin = (nn.Linear(D, HEADS * HEAD_DIM) for _ in range(3))
        self.out_lin = nn.Linear(HEADS * HEAD_DIM, D)

    def forward(self, x, cos, sin):
        bs, qlen, _ = x.shape
        q = self.q_lin(x).view(bs, -1, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_lin(x).view(bs, -1, HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_lin(x).view(bs, -1, HEADS, HEAD_DIM).transpose(1, 2)
        empty = torch.tensor([], dtype=k.dtype, device=k.device)  # a cache that starts empty
        k, v = torch.cat([empty, k], dim=-2), torch.cat([empty, v], dim=-2)
        scores = torch.matmul(q / HEAD_DIM ** 0.5, k.transpose(2, 3))
        causal = torch.ones(qlen, qlen, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(-1), v)
        return self.out_lin(out.transpose(1, 2).reshape(bs, qlen, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, lambda: nn.LayerNorm(D), CachedAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
