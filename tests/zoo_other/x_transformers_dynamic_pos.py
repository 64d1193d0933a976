"""x-transformers' decoder with a dynamic position bias and a Primer-style feed-forward (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: a dynamic
position bias (``dynamic_pos_bias``, ``DynamicPositionBias``: each relative position -7..7 as ``sign * log(|p| + 1)``
(``dynamic_pos_bias_log_distance``) fed through a small MLP, Linear(1, 16) -> LayerNorm (``dynamic_pos_bias_norm``) ->
SiLU -> Linear(16, 16) -> LayerNorm -> SiLU -> Linear(16, heads), indexed by i - j into one bias per head added to the
[heads, i, j] scores, shared by every layer), a squared-ReLU feed-forward (``ff_relu_squared``, Primer) with a LayerNorm
after the activation (``ff_post_act_ln``), LIMe layer integration (``integrate_layers``: each layer's input a learned,
input-dependent mix of every earlier layer's output, queries, keys and values each reading their own mix,
``DynamicLIMe``), pre-norm RMSNorm, grouped-query attention (4 query heads, 2 key/value heads), no absolute or rotary
positions, the attention written out (``attn_flash=False``); dim 64, 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = ("x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, DynamicPositionBias, "
          "FeedForward, ReluSquared, DynamicLIMe, RMSNorm)")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            dynamic_pos_bias=True, dynamic_pos_bias_log_distance=True, dynamic_pos_bias_norm=True,
                            ff_relu_squared=True, ff_post_act_ln=True, integrate_layers=True, use_rmsnorm=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
