"""x-transformers' decoder with value residuals and hyper-connections (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: value
residual learning (``add_value_residual``, ResFormer: every later layer's values lerped towards the first layer's
values, by a per-token, per-head mix ``to_value_residual_mix``, a linear and a sigmoid, ``learned_value_residual_mix``),
hyper-connections (``num_residual_streams=2``: the residual stream widened to 2 copies folded into the batch,
``(b s) n d``, each branch reading a learned, input-dependent mix of the streams and writing back to each with its own
weight, ``HyperConnection``), Dynamic Tanh in place of the norms (``use_dynamic_tanh``, ``DynamicTanh``:
``tanh(alpha x) * g + b``), a GELU feed-forward with a GLU (``ff_glu``), rotary positions, 4 heads (no grouped-query attention:
``to_value_residual_mix`` is ``nn.Linear(dim, heads)``, one mix per query head, which x-transformers lerps with
values of ``kv_heads`` heads, x_transformers.py:2418, so ``attn_kv_heads=2`` fails in eager), the attention written out
(``attn_flash=False``); dim 64, 2 layers, vocabulary 128 (at 4 layers
hyper-connections with Dynamic Tanh's unnormalized streams make 3 SGD steps ill-conditioned: eager fp32 differs from
fp64 by 1.4e-4, so no layout can be held to 2e-5).
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = "x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, HyperConnection, DynamicTanh)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_dim_head=HEAD_DIM,
                            add_value_residual=True, learned_value_residual_mix=True, num_residual_streams=2,
                            use_dynamic_tanh=True, ff_glu=True, rotary_pos_emb=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
