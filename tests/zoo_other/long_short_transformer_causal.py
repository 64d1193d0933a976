"""lucidrains' Long-Short Transformer (``long_short_transformer.LongShortTransformer``, pip
``long-short-transformer``), its own classes unchanged, causal (``causal=True``): ``LongShortAttention`` per layer,
with keys and values tied (one ``to_kv``; ``to_q`` apart), rotary positions on queries and keys/values
(``apply_rotary_emb``); a short-term part of sliding-window attention (the sequence windowed by ``window_size``,
each window's queries against its own and the previous window's keys (``look_around``: ``F.pad`` and slices), the
keys LayerNormed (``local_norm``), causally masked by in-place ``masked_fill_``) and a long-term part of dynamic
projection per segment (``to_dynamic_proj``: each segment of ``segment_size`` keys compressed to ``r`` by a softmax
over its positions, LayerNormed (``global_norm``), a position attending only to segments it has reached, masked by
``masked_fill_``); both similarities concatenated into one softmax, values the same tensors; pre-LayerNorm residual
attention and GELU feed-forward, a final LayerNorm and an untied head. dim 64, 4 heads of 16 (no grouped-query
form), 2 layers, ff_mult 2, vocabulary 128, ``window_size`` 4 and ``segment_size`` 4 (2 windows and 2 segments in 8
tokens), ``r`` 1 (its causal default), dropout 0.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from long_short_transformer import LongShortTransformer

LIBRARY, VERSION = "long-short-transformer", version("long-short-transformer")
SOURCE = ("long_short_transformer/long_short_transformer.py (LongShortTransformer, LongShortAttention, look_around, "
          "PreNorm, FeedForward), rotary_embedding_torch (RotaryEmbedding, apply_rotary_emb)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention (keys and values tied), no grouped-query form


def model():
    torch.manual_seed(0)
    return LongShortTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, max_seq_len=SEQ * 8, window_size=4,
                                causal=True, dim_head=HEAD_DIM, heads=HEADS, ff_mult=2, segment_size=4, r=1,
                                ff_dropout=0., attn_dropout=0.)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
