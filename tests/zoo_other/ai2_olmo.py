"""AllenAI's original OLMo training code (``olmo.model.OLMo``, pip ``ai2-olmo``; not OLMo-core), its own classes
unchanged, built from ``olmo.config.ModelConfig`` at the tiny size: d_model 64, 4 query heads of 16, 2 key/value
heads, 2 layers, SwiGLU (``mlp_hidden_size`` 256, which the SwiGLU halves to an MLP of 128), vocabulary 128, rotary
positions (theta 500000), RMSNorm, q/k LayerNorms over the whole q and k widths (``attention_layer_norm``), no
biases, untied head, every dropout off; initialised by OLMo's own ``reset_parameters`` (called by its constructor).

``OLMO_BLOCK`` picks the block: ``sequential`` (default: ``OLMoSequentialBlock``, one fused ``att_proj`` for q, k, v
and one ``ff_proj`` for SwiGLU's two halves, pre-norm) or ``llama`` (``OLMoLlamaBlock``: separate q/k/v projections
and a hand-written softmax attention). ``OLMO_NORM_AFTER=1`` sets ``norm_after`` (OLMo 2's reordered norms).
"""
import os

import torch
from other_common import (FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "OLMo (ai2-olmo)", version("ai2-olmo")
SOURCE = "olmo/model.py (OLMo, OLMoSequentialBlock, OLMoLlamaBlock, RotaryEmbedding, RMSLayerNorm, SwiGLU)"
BLOCK = os.environ.get("OLMO_BLOCK", "sequential")
NORM_AFTER = os.environ.get("OLMO_NORM_AFTER", "0") == "1"
HEADS_ = HEADS
# OLMoLlamaBlock sizes k_proj and v_proj by d_model whatever n_kv_heads says (only multi_query_attention shrinks
# them), so it is built with n_kv_heads equal to n_heads.
KV_HEADS_ = HEADS if BLOCK == "llama" else KV_HEADS


def config():
    from olmo.config import ModelConfig

    return ModelConfig(
        d_model=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS_, n_layers=LAYERS, mlp_hidden_size=2 * FFN,
        activation_type="swiglu", block_type=BLOCK, rope=True, rope_theta=500_000, flash_attention=False,
        attention_layer_norm=True, layer_norm_type="rms", layer_norm_eps=1e-6, norm_after=NORM_AFTER,
        include_bias=False, weight_tying=False, vocab_size=VOCAB, embedding_size=VOCAB,
        max_sequence_length=SEQ * 8, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
        init_device="cpu", init_fn="normal", init_std=0.02, init_cutoff_factor=3.0)


def model():
    from olmo.model import OLMo

    torch.manual_seed(0)
    return OLMo(config())  # init_params=True: its constructor calls reset_parameters()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
