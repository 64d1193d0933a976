"""x-transformers' post-norm decoder with LayerScale, memory tokens and tied embeddings (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: post-norm
(``pre_norm=False``: each branch's sum with the residual normalized, as the original Transformer), the residual scaled
by a learned per-channel vector (``scale_residual``), LayerScale on every branch output (``use_layerscale``,
``layerscale_init_value=0.1``, ``LayerScale``), values gated per channel by a SiLU of a projection of the input
(``attn_gate_values`` with ``attn_swiglu_values``), a GELU GLU feed-forward (``ff_glu``), 2 learned memory tokens
prepended to the sequence and dropped from the output (``num_memory_tokens=2``: the attention sees 10 positions),
the embedding tied to the output projection (``tie_embedding``) and normalized after the lookup (``post_emb_norm``),
rotary positions, grouped-query attention (4 query heads, 2 key/value heads), the attention written out
(``attn_flash=False``); dim 64, 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = ("x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, LayerScale, Residual, "
          "TokenEmbedding)")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False, num_memory_tokens=2, tie_embedding=True,
        post_emb_norm=True,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            pre_norm=False, scale_residual=True, use_layerscale=True, layerscale_init_value=0.1,
                            attn_gate_values=True, attn_swiglu_values=True, ff_glu=True, rotary_pos_emb=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
