"""lucidrains' H-Transformer-1D (``h_transformer_1d.HTransformer1D``, pip ``h-transformer-1d``), its own classes
unchanged, causal (``causal=True``): hierarchical attention (``CausalHAttention1D``: one fused ``to_qkv`` chunked in
three; rotary positions applied to queries, keys and values (``apply_rotary_emb``); the sequence padded to a power of
2 and coarsened level by level (pairs averaged for q and k, summed for v); per level, blocks of ``block_size`` with
keys/values flipped pairwise (``flip_every_two``: ``torch.flip``) for the off-diagonal blocks, the right
off-diagonals dropped and padded back, the finest level's diagonal blocks causally masked; unnormalised
``exp(S - max)`` attention per level, the levels upsampled (``repeat``), stacked, masked by a registered causal
``mask`` buffer and summed, then divided by the summed weights), pre-LayerNorm residual blocks
(``SequentialSequence``), a GELU feed-forward, a final LayerNorm and an untied head. dim 64, 4 heads of 16 (no
grouped-query form), 2 layers, ff_mult 2, vocabulary 128, ``max_seq_len`` 8 and ``block_size`` 2 (4 blocks: one
coarse level above the diagonal), not reversible, no token shift.

``h_transformer_1d_reversible.py`` builds the README's configuration (``reversible=True``, ``shift_tokens=True``).
"""
import os

import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from h_transformer_1d import HTransformer1D

LIBRARY, VERSION = "h-transformer-1d", version("h-transformer-1d")
REVERSIBLE = os.environ.get("H_TRANSFORMER_REVERSIBLE", "0") == "1"
SOURCE = ("h_transformer_1d/h_transformer_1d.py (HTransformer1D, CausalHAttention1D, PreNorm, FeedForward"
          + (", PreShiftTokens), h_transformer_1d/reversible.py (ReversibleSequence, ReversibleBlock, "
             "_ReversibleFunction, Deterministic)" if REVERSIBLE else
             "), h_transformer_1d/reversible.py (SequentialSequence)")
          + ", rotary_embedding_torch (RotaryEmbedding, apply_rotary_emb)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form


def model():
    torch.manual_seed(0)
    return HTransformer1D(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, max_seq_len=SEQ, causal=True, heads=HEADS,
                          dim_head=HEAD_DIM, ff_mult=2, block_size=2, reversible=REVERSIBLE,
                          shift_tokens=REVERSIBLE)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
