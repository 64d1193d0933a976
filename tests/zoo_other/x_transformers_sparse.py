"""x-transformers' decoder with top-k sparse attention and attention-on-attention (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: top-k sparse
attention (``attn_sparse_topk=4``: each query's scores below its 4th largest masked out before the softmax,
``sparse_topk_attn``: ``topk``, a comparison and ``masked_fill``), LASER attention (``attn_laser``: the softmax
applied to ``exp`` of the soft-clamped values and the output's ``log`` taken, ``laser_softclamp_value``), a learned
attention sink per head (``attn_head_learned_sink``: one logit per head joined to every query's scores, dropped after
the softmax), attention on attention (``attn_on_attn``: the output projection widened to 2 dim and a ``nn.GLU``),
rotary positions, grouped-query attention (4 query heads, 2 key/value heads), the attention written out
(``attn_flash=False``); dim 64, 2 layers, vocabulary 128.
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
                            attn_sparse_topk=4, attn_laser=True, attn_head_learned_sink=True, attn_on_attn=True,
                            rotary_pos_emb=True, attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
