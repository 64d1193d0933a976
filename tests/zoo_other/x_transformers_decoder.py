"""x-transformers' decoder (lucidrains, ``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``),
its own classes unchanged, configured as a Llama-style decoder: pre-norm RMSNorm (``use_rmsnorm``: x-transformers'
``F.normalize(x, dim=-1) * sqrt(dim) * g``), rotary positions, grouped-query attention (4 query heads, 2 key/value
heads), a SwiGLU feed-forward (``ff_glu``, ``ff_swish``), no absolute positions; dim 64, 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, RMSNorm)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            use_rmsnorm=True, rotary_pos_emb=True, ff_glu=True, ff_swish=True, ff_mult=2,
                            attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
