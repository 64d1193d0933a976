"""lucidrains' gMLP language model (``g_mlp_pytorch.gMLP``, pip ``g-mlp-pytorch``), its own classes unchanged, causal
(``causal=True``): a token embedding, ``LAYERS`` residual pre-LayerNorm blocks (``Residual(PreNorm(PreShiftTokens(
gMLPBlock)))``, no token shift) of ``proj_in`` (``Linear(dim, dim * ff_mult)`` + GELU), a ``SpatialGatingUnit``
(the hidden chunked in two halves; the gate half LayerNormed then mixed across positions by a learned
``[heads, seq_len, seq_len]`` weight, sliced to ``[:n, :n]`` and masked upper-triangular to 0 for causality, by
``einsum('b h n d, h m n -> b h m d')`` plus a per-position bias ``[heads, seq_len]``; gate times the other half)
and ``proj_out``; a final LayerNorm and an untied head. dim 64, 2 layers, seq_len 8, ff_mult 2, one spatial head,
no tiny attention (``attn_dim=None``), ``prob_survival=1`` (no layer dropping), vocabulary 128.

The spatial gating unit mixes positions with a learned weight indexed by absolute position (query row, key column):
no heads, no key/values.
"""
import torch
from other_common import HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from g_mlp_pytorch import gMLP

LIBRARY, VERSION = "g-mlp-pytorch", version("g-mlp-pytorch")
SOURCE = "g_mlp_pytorch/g_mlp_pytorch.py (gMLP, gMLPBlock, SpatialGatingUnit, PreShiftTokens, PreNorm, Residual)"
HEADS_, KV_HEADS_ = 1, None  # one spatial-gating head; no key/value heads


def model():
    torch.manual_seed(0)
    return gMLP(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, seq_len=SEQ, ff_mult=2, causal=True, heads=1,
                prob_survival=1.)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
