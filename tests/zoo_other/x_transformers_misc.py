"""x-transformers' decoder with residual attention, token shift and macaron feed-forwards (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: residual
attention (``residual_attn``: each layer's pre-softmax scores are added to the next layer's, RealFormer), token shift
(``shift_tokens=1``: the first half of each branch's input channels shifted one position forward, ``ShiftTokens``),
a macaron layout (``macaron``: a half-scaled feed-forward before and after each attention, layers ``f a f``),
ScaleNorm (``use_scalenorm``: ``x / ||x|| * g``, one learned scalar per norm), rotary positions, 4 heads (no
grouped-query attention), the attention written out (``attn_flash=False``, which residual attention needs); dim 64,
2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, ShiftTokens, Scale, ScaleNorm)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM,
                            residual_attn=True, shift_tokens=1, macaron=True, use_scalenorm=True,
                            rotary_pos_emb=True, attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
