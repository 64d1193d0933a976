"""lucidrains' local-attention (``local_attention.LocalTransformer``, pip ``local-attention``), its own classes
unchanged: a causal language model of local windowed attention (``LocalMHA`` over ``LocalAttention``: the sequence
bucketed into windows of ``local_attn_window_size``, each window's queries attending to its own and the previous
window's keys (``look_around``, ``look_backward=1``), masked to an exact causal window), rotary positions inside the
windows plus learned absolute positions, pre-norm LayerNorm, fused ``to_qkv``, a GEGLU feed-forward, and its default
hyper-connections (``hyper_connections``, 4 residual streams folded into the batch), at the tiny size: dim 64, 4
heads of 16 (no grouped-query attention), 2 layers, a feed-forward of 128 (``ff_mult=3``: ``int(64 * 3 * 2 / 3)``),
vocabulary 128, a window of 4 (2 windows in the sequence of 8, so it masks).

hyper-connections picks each block's initial residual stream with Python's ``random.randrange``
(``hyper_connections.py:215``, ``static_alpha``'s one-hot column), so ``model()`` seeds Python's ``random`` as well as
torch's: unseeded, every build differs (pp and tp were set against a different eager model, 1.0 apart).
"""
import random

import torch
from local_attention import LocalTransformer
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)

LIBRARY, VERSION = "local-attention", version("local-attention")
SOURCE = "local_attention/{transformer,local_attention,rotary}.py, hyper_connections"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    random.seed(0)
    return LocalTransformer(num_tokens=VOCAB, max_seq_len=SEQ * 8, dim=HIDDEN, depth=LAYERS, causal=True,
                            local_attn_window_size=4, dim_head=HEAD_DIM, heads=HEADS, ff_mult=3,
                            attn_dropout=0.0, ff_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
