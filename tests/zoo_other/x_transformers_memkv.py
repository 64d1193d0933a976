"""x-transformers' decoder with memory key/values and gated attention (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: 4 learned
memory key/value slots per key/value head prepended to every layer's keys and values (``attn_num_mem_kv``, the
``mem_k``/``mem_v`` parameters), the attention output gated per channel by a sigmoid of a projection of the input
(``attn_gate_values``, ``to_v_gate``), sandwich norm (``sandwich_norm``: a second LayerNorm on each branch's output
before the residual add), bias-free feed-forward linears (``ff_no_bias``), rotary positions, grouped-query attention
(4 query heads, 2 key/value heads), the attention written out (``attn_flash=False``); dim 64, 2 layers, vocabulary
128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, FeedForward)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            attn_num_mem_kv=4, attn_gate_values=True, sandwich_norm=True, ff_no_bias=True,
                            rotary_pos_emb=True, attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
