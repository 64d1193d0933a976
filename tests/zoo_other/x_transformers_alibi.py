"""x-transformers' decoder with ALiBi (lucidrains, ``x_transformers.TransformerWrapper`` + ``Decoder``, pip
``x-transformers``), its own classes unchanged: ALiBi linear position biases (``alibi_pos_bias``,
``AlibiPositionalBias``) on 2 of the 4 heads (``alibi_num_heads=2``, the other heads' bias padded with zeros), no
rotary or absolute positions, a SwiGLU feed-forward (``ff_glu``, ``ff_swish``), pre-norm LayerNorm, the attention
written out (``attn_flash=False``: softmax of q k^T plus the bias); dim 64, 4 heads (no grouped-query attention:
``KV_HEADS_`` is the head count), 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, AlibiPositionalBias)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM,
                            alibi_pos_bias=True, alibi_num_heads=HEADS // 2, attn_flash=False,
                            ff_glu=True, ff_swish=True, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
