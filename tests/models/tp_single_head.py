"""One attention head as wide as the layer, as Mega writes its attention (``mega_pytorch``'s ``SingleHeadedAttention``:
``einsum('b i d, b j d -> b i j', q, k)``, softmax, ``einsum('b i j, b j d -> b i d', attn, v)``): under ``--tp 2``
the value's features are sharded beside whole attention weights, which is no key/value head read by sharded heads
(x-transformers' one key/value head, ``"b h i d, b j d -> b h i j"``): the layer keeps its Megatron figure. Lit-gpt's
decoder otherwise, hidden 64, 2 layers, 16 tokens.
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, Decoder, RMSNorm, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class SingleHeadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.to_out = nn.Linear(D, D, bias=False)

    def forward(self, x, cos, sin):
        T = x.shape[1]
        sim = torch.einsum("b i d, b j d -> b i j", self.to_q(x), self.to_k(x)) * D ** -0.5
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        return self.to_out(torch.einsum("b i j, b j d -> b i d", attn, self.to_v(x)))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), SingleHeadAttention, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
