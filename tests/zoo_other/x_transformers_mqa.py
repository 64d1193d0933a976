"""x-transformers' decoder with multi-query attention and a data-dependent ALiBi (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: multi-query
attention (``attn_one_kv_head``: one key/value head shared by the 4 query heads), a data-dependent ALiBi
(``attn_data_dependent_alibi``, ``DataDependentAlibi``, the Forgetting Transformer: a per-token, per-head forget gate
``logsigmoid`` of a projection of the input, cumulatively summed along the sequence, the differences added to the
scores), an output gate on the attention (``attn_output_gate``: the merged heads multiplied by a sigmoid of a
projection of themselves, hybrid gated attention), pre-norm LayerNorm, no absolute or rotary positions, the
attention written out (``attn_flash=False``); dim 64, 2 layers, vocabulary 128. ``KV_HEADS_`` is 1: one key/value
head is the point of the flag.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, DataDependentAlibi, LoRALinear)"
HEADS_, KV_HEADS_ = HEADS, 1


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_one_kv_head=True, attn_dim_head=HEAD_DIM,
                            attn_data_dependent_alibi=True, attn_output_gate=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
