"""Issue 57: attention experts written as grouped 1 x 1 convolutions, as lucidrains' mixture-of-attention writes its
``Attention`` (``mixture_of_attention.py``): the experts' inputs folded into the channels (``'b g n d -> b (g d) n'``),
``to_q``, ``to_k``, ``to_v`` and ``to_out`` each one ``Conv1d(..., kernel_size=1, groups=experts)``, the heads split
out of each expert's channels (``'b (g h d) n -> (b g) h n d'``) for ``F.scaled_dot_product_attention``, and the
experts' outputs summed. Here every expert reads every token, each through its own scale of the normed input (the
library routes a few tokens to each); 2 experts of 4 heads of 16, 2 layers, hidden 64, 16 tokens.

A grouped 1 x 1 convolution is a block-diagonal linear over the channels: column-wise, each rank holds its piece of
each expert's output channels (its heads of every expert), the convolution keeping its groups; row-wise, its piece of
each expert's input channels, the weight's rows over one group's inputs cut alike. Before, no rule placed a grouped
convolution of a whole input, and every expert projection was whole on every rank (mixture-of-attention at 0.49 of
each layer).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEAD_DIM, HEADS, Decoder, RMSNorm, SwiGLU, loss_fn, sgd, token_batch

EXPERTS = 2
INNER = HEADS * HEAD_DIM


class GroupedConvExperts(nn.Module):
    def __init__(self):
        super().__init__()
        g = EXPERTS
        self.scales = nn.Parameter(torch.ones(g, 1, D) + 0.1 * torch.randn(g, 1, D))
        self.to_q = nn.Conv1d(D * g, INNER * g, 1, bias=False, groups=g)
        self.to_k = nn.Conv1d(D * g, INNER * g, 1, bias=False, groups=g)
        self.to_v = nn.Conv1d(D * g, INNER * g, 1, bias=False, groups=g)
        self.to_out = nn.Conv1d(INNER * g, D * g, 1, bias=False, groups=g)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        g = EXPERTS
        x = (x[:, None] * self.scales).transpose(-1, -2).reshape(b, g * D, n)  # 'b g n d -> b (g d) n'
        q, k, v = (proj(x).reshape(b, g, HEADS, HEAD_DIM, n).permute(0, 1, 2, 4, 3).reshape(b * g, HEADS, n, HEAD_DIM)
                   for proj in (self.to_q, self.to_k, self.to_v))  # 'b (g h d) n -> (b g) h n d'
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.reshape(b, g, HEADS, n, HEAD_DIM).permute(0, 1, 2, 4, 3).reshape(b, g * INNER, n)
        out = self.to_out(out).reshape(b, g, D, n)  # 'b (g d) n -> b g d n'
        return out.sum(dim=1).transpose(1, 2)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), GroupedConvExperts, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
