"""Issue 57: talking-heads attention as x-transformers writes it (``x_transformers/attend.py``, ``Attend`` with
``pre_talking_heads`` and ``post_talking_heads``): the ``[b, heads, i, j]`` scores mixed across heads by a 1 x 1
``nn.Conv2d(heads, heads, 1, bias=False)`` before the softmax (its output added to the scores), the attention
weights mixed across heads again after it; 4 query heads of 16, 2 key/value heads tiled by ``repeat``,
``F.normalize`` RMSNorm, a SwiGLU MLP; 2 layers, hidden 64, 16 tokens.

Each talking-heads convolution is a sum over all heads: with the heads sharded, its partial sums would be the
scores themselves, reduce-scattered twice a layer (b h s^2 each way), where computing the attention whole on every
rank costs 2 d_head FLOPs a score. The plan keeps the queries' and keys' projections and the scores whole, the
values' and the output projection sharded (``tests/test_other_libraries.py``).
"""
import functools

import torch
import torch.nn as nn
from lib_style import (D, HEAD_DIM, HEADS, Decoder, NormalizeRMSNorm, SeparateAttention, SwiGLU, loss_fn,  # noqa: F401
                       sgd, token_batch)
from tiny_lm import examples_of

KV_HEADS = 2


class TalkingHeadsAttention(SeparateAttention):
    def __init__(self, kv_heads):
        super().__init__(kv_heads)
        self.pre_softmax_talking_heads = nn.Conv2d(HEADS, HEADS, 1, bias=False)
        self.post_softmax_talking_heads = nn.Conv2d(HEADS, HEADS, 1, bias=False)
        with torch.no_grad():  # x-transformers initialises both to the identity (dirac); a little off it here
            for conv in (self.pre_softmax_talking_heads, self.post_softmax_talking_heads):
                conv.weight.mul_(0.1).add_(nn.init.dirac_(torch.empty_like(conv.weight)))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.tiled(x)
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5
        sim = sim + self.pre_softmax_talking_heads(sim)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        attn = self.post_softmax_talking_heads(attn)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(NormalizeRMSNorm, D), functools.partial(TalkingHeadsAttention, KV_HEADS),
                   SwiGLU)


batch = token_batch
example_inputs, example_target = examples_of(batch)


optimizer = sgd
