"""x-transformers' decoder with talking heads (lucidrains, ``x_transformers.TransformerWrapper`` + ``Decoder``, pip
``x-transformers``), its own classes unchanged: talking-heads attention (``attn_pre_talking_heads``,
``attn_post_talking_heads``: the [batch, heads, i, j] scores mixed across heads by a 1x1 ``nn.Conv2d(heads, heads)``
before the softmax, added to the scores, and the attention weights mixed across heads again after it, both
initialised to the identity, ``Attend``), a learned per-head output scale (``attn_head_scale``,
``head_scale_params`` [1, heads, 1, 1]), rotary positions, grouped-query attention (4 query heads, 2 key/value heads,
``attn_kv_heads``), the attention written out (``attn_flash=False``, which talking heads need); dim 64, 2 layers,
vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention), x_transformers/attend.py (Attend)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            attn_pre_talking_heads=True, attn_post_talking_heads=True, attn_head_scale=True,
                            rotary_pos_emb=True, attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
