"""Every head taken one by one from the sharded heads and run apart, as Zamba's Mamba layer in transformers writes its
scan (``modeling_zamba.py``: ``for head_idx in range(self.n_mamba_heads)``, ``hidden_states_B_C[head_idx]``,
``B[head_idx]``, ``C[head_idx]``, then ``torch.cat`` of the heads' outputs): here the attention of each head,
``q[:, h]``, ``k[:, h]``, ``v[:, h]`` for h in 0..3, joined by ``torch.stack``. Hidden 64, 4 heads of 16, 2 layers,
16 tokens.

A select of one index of the sharded heads, read whole, is taken by the rank that holds it and all-reduced
(``tp_owned_select``): the bytes of one head where a gather moves every head. Taken for every head in turn, those
all-reduces move twice what one gather of the heads moves, and every rank still computes every head: Zamba's plan
went from 40 to 128 KiB a layer (4.0x Megatron's). Where the selects take half the indices or more, they are not
owned.
"""
import functools

import torch
import torch.nn.functional as F
from lib_style import D, HEADS, HEAD_DIM, Decoder, RMSNorm, SeparateAttention, SwiGLU, apply_rope, loss_fn, sgd, token_batch  # noqa: F401


class HeadByHeadAttention(SeparateAttention):
    def heads(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, HEADS, HEAD_DIM).transpose(1, 2) for proj in (self.to_q, self.to_k, self.to_v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        outs = [F.scaled_dot_product_attention(q[:, h], k[:, h], v[:, h], is_causal=True) for h in range(HEADS)]
        return torch.stack(outs, dim=1)


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(RMSNorm, D), functools.partial(HeadByHeadAttention, HEADS), SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
