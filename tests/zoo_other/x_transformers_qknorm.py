"""x-transformers' decoder with query/key normalization (lucidrains, ``x_transformers.TransformerWrapper`` +
``Decoder``, pip ``x-transformers``), its own classes unchanged: cosine-similarity attention (``attn_qk_norm``: q and
k l2-normalized per head; ``attn_qk_norm_dim_scale``: then multiplied by learned per-head, per-channel scales
``qk_norm_q_scale`` [heads, 1, dim_head] and ``qk_norm_k_scale`` [kv_heads, 1, dim_head], initialised to
dim_head ** 0.25, the logits scaled by 1/sqrt(dim_head) as usual), xPos rotary positions
(``rotary_xpos``: rotary with a decaying scale on q and 1/scale on k), simple RMSNorm (``use_simple_rmsnorm``:
``F.normalize(x, dim=-1) * sqrt(dim)``, no gain), grouped-query attention (4 query heads, 2 key/value heads,
``attn_kv_heads``), the attention written out (``attn_flash=False``); dim 64, 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, RotaryEmbedding, SimpleRMSNorm)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            attn_qk_norm=True, attn_qk_norm_dim_scale=True, rotary_xpos=True, use_simple_rmsnorm=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
