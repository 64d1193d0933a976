"""x-transformers' decoder with T5 relative position buckets (lucidrains, ``x_transformers.TransformerWrapper`` +
``Decoder``, pip ``x-transformers``), its own classes unchanged: a T5-style bucketed relative position bias
(``rel_pos_bias``, ``RelativePositionBias``: the causal distance j - i put in 8 buckets, log-spaced up to 16, looked
up in an ``nn.Embedding(buckets, heads)`` shared by every layer and added to the [heads, i, j] scores), attention
logits soft-clamped (``attn_softclamp_logits``: ``tanh(s / 50) * 50``), a GRU-gated residual (``gate_residual``,
``GRUGating``: ``nn.GRUCell(dim, dim)`` on the branch output and the residual instead of the add), pre-norm RMSNorm,
grouped-query attention (4 query heads, 2 key/value heads), the attention written out (``attn_flash=False``); dim 64,
2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = ("x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, RelativePositionBias, "
          "GRUGating), x_transformers/attend.py (Attend)")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            rel_pos_bias=True, rel_pos_num_buckets=8, rel_pos_max_distance=16,
                            attn_softclamp_logits=True, gate_residual=True, use_rmsnorm=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
