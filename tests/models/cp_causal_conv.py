"""Causal convolutions along the sequence, as two libraries write them, between attention layers:

* LFM2's short convolution (transformers' ``Lfm2ShortConv.slow_forward``): ``in_proj`` to B, C and x, the gated
  ``B * x`` through a depth-wise ``nn.Conv1d(padding=L_cache - 1)``, the output cut back to the sequence with
  ``[..., :seqlen]``, gated by C;
* Primer EZ's multi-DConv-head attention (labml-nn's ``SpatialDepthWiseConvolution``, ``primer_ez/__init__.py:96``):
  q, k and v each through a depth-wise convolution over every head's channels, ``padding=kernel_size - 1``, the
  last ``kernel_size - 1`` outputs dropped with ``[:, :, :-(kernel_size - 1)]`` (the values' convolution written as
  lucidrains' ``CausalConv1d``: ``F.pad(x, (kernel_size - 1, 0))``, then unpadded); then causal attention;
* x-transformers' token shift before each feed-forward: half the features moved one position later,
  ``F.pad(t, (0, 0, 1, -1))``.

Each output position reads its own and the ``kernel - 1`` (or 1) positions before it. Under ``--cp`` a rank's chunks need
the positions just before each of them, which the rank before holds (``cp_halo``): refused before ("a convolution
along the sequence dim"). ``CONV_KERNEL`` sets the kernel (3 by default; 6 reaches past a whole chunk at 16 tokens
and ``--cp 2``: each chunk is 4 positions); ``CONV_CENTERED=1`` centres the short convolution (each position reads
the positions after it too: refused by name); ``CONV_SEQ=dynamic`` changes the sequence length per step (16, 8, 12: a
dynamic dim). Lit-gpt's decoder around them (``lib_style.Decoder``); hidden 64, 16
tokens, a batch of 4.
"""
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import (BATCH, D, HEAD_DIM, HEADS, VOCAB, Decoder, RMSNorm, SwiGLU, apply_rope, loss_fn,  # noqa: F401
                       sgd, token_batch)

KERNEL = int(os.environ.get("CONV_KERNEL", "3"))
CENTERED = os.environ.get("CONV_CENTERED") == "1"  # the short convolution centred (padding k // 2, no cut): not causal


class ShortConv(nn.Module):
    """LFM2's gated short convolution."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D, 3 * D, bias=False)
        self.conv = nn.Conv1d(D, D, kernel_size=KERNEL, groups=D, padding=KERNEL // 2 if CENTERED else KERNEL - 1,
                              bias=False)
        self.out_proj = nn.Linear(D, D, bias=False)

    def forward(self, x, cos=None, sin=None):
        seqlen = x.shape[1]
        BCx = self.in_proj(x).transpose(-1, -2)
        B, C, x = BCx.chunk(3, dim=-2)
        conv_out = self.conv(B * x)[..., :seqlen]
        return self.out_proj((C * conv_out).transpose(-1, -2).contiguous())


class SpatialDepthWiseConvolution(nn.Module):
    """labml's, batch first: ``[b, s, heads * d]`` -> a depth-wise causal convolution along ``s``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, kernel_size=KERNEL, padding=KERNEL - 1, groups=D)

    def forward(self, x):
        x = self.conv(x.transpose(1, 2))
        return x[:, :, :-(KERNEL - 1)].transpose(1, 2)


class CausalConv1d(nn.Module):
    """lucidrains' (and WaveNet-style audio code's) causal convolution, batch first: ``F.pad(x, (k - 1, 0))`` along
    the sequence, then an unpadded ``nn.Conv1d``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, kernel_size=KERNEL, groups=D)

    def forward(self, x):
        return self.conv(F.pad(x.transpose(1, 2), (KERNEL - 1, 0))).transpose(1, 2)


class PrimerEZAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(D, HEADS * HEAD_DIM) for _ in range(3))
        self.query_conv, self.key_conv = SpatialDepthWiseConvolution(), SpatialDepthWiseConvolution()
        self.value_conv = CausalConv1d()
        self.output = nn.Linear(HEADS * HEAD_DIM, D)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape

        def heads(t):
            return t.view(B, T, HEADS, HEAD_DIM).transpose(1, 2)

        q = heads(self.query_conv(self.query(x)))
        k = heads(self.key_conv(self.key(x)))
        v = heads(self.value_conv(self.value(x)))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output(out.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM))


class Mixer(nn.Module):
    """LFM2's short convolution in even layers, Primer EZ's attention in odd ones."""
    layers = 0

    def __init__(self):
        super().__init__()
        self.mix = ShortConv() if Mixer.layers % 2 == 0 else PrimerEZAttention()
        Mixer.layers += 1

    def forward(self, x, cos, sin):
        return self.mix(x, cos, sin)


class ShiftedSwiGLU(SwiGLU):
    """x-transformers' ``ShiftTokens((0, 1), FeedForward)``: half the features shifted one position along the
    sequence, ``F.pad(t, (0, 0, 1, -1))`` (FLASH and RWKV shift tokens alike)."""

    def forward(self, x):
        kept, shifted = x.chunk(2, dim=-1)
        return super().forward(torch.cat([kept, F.pad(shifted, (0, 0, 1, -1), value=0.0)], dim=-1))


def model():
    torch.manual_seed(0)
    Mixer.layers = 0
    return Decoder(2, functools.partial(RMSNorm, D), Mixer, ShiftedSwiGLU)


SEQS = (16, 8, 12)  # CONV_SEQ=dynamic: the sequence length changes per step (a dynamic dim)
DYNAMIC = os.environ.get("CONV_SEQ") == "dynamic"

if DYNAMIC:
    from torch.export import Dim

    dynamic_shapes = {"idx": {1: Dim("seq", min=4, max=16)}}  # (export guards 17 away)


def batch(step):
    if not DYNAMIC:
        return token_batch(step)
    g = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQS[step % len(SEQS)] + 1), generator=g)
    return (tokens[:, :-1],), {}, tokens[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
