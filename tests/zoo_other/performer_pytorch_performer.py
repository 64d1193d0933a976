"""lucidrains' performer-pytorch (``performer_pytorch.PerformerLM``, pip ``performer-pytorch``), its own classes
unchanged: a causal language model of FAVOR+ attention (``FastAttention``: queries and keys through the positive
random-feature softmax kernel, ``softmax_kernel`` over a fixed Gaussian orthogonal projection buffer of
``int(16 * ln 16) = 44`` features per head, then causal linear attention as prefix sums over the sequence,
``causal_linear_attention_noncuda``: ``cumsum`` of k and of k (x) v), rotary positions per layer plus fixed sinusoidal
absolute positions, pre-LayerNorm, q/k/v as three projections, a GELU feed-forward, at the tiny size: dim 64, 4 heads
of 16 (no grouped-query attention), 2 layers, a feed-forward of 128 (``ff_mult=2``), vocabulary 128. One change
of configuration: ``auto_check_redraw=False``, so a forward does not count calls in a buffer and redraw the random
projections every ``feature_redraw_interval`` (1000) calls (``ProjectionUpdater``; 3 training steps would never reach
a redraw, and a training loop may call ``check_redraw_projections`` itself, as the library allows).
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from performer_pytorch import PerformerLM

LIBRARY, VERSION = "performer-pytorch", version("performer-pytorch")
SOURCE = "performer_pytorch/performer_pytorch.py (PerformerLM, Performer, Attention, FastAttention)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    return PerformerLM(num_tokens=VOCAB, max_seq_len=SEQ * 8, dim=HIDDEN, depth=LAYERS, heads=HEADS,
                       dim_head=HEAD_DIM, causal=True, ff_mult=2, auto_check_redraw=False,
                       ff_dropout=0.0, attn_dropout=0.0, emb_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
