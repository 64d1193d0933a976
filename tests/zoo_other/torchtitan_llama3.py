"""torchtitan's Llama 3 (``torchtitan.models.llama3``, pip ``torchtitan`` 0.3.0), its own classes unchanged.

Built as torchtitan's ``llama3`` config registry builds its flavours (``_build_llama3_layers``: fused qkv, GQA,
SwiGLU, RMSNorm, rotary in complex numbers with llama scaling), at the tiny size of ``other_common``: dim 64, 4
query heads, 2 key/value heads, 2 layers, vocabulary 128. One change of configuration: the inner attention is
torchtitan's ``ScaledDotProductAttention`` (causal), which its registry no longer offers language models (they
take flex or varlen attention, from per-document positions); the module is torchtitan's own.

torchtitan fuses q, k and v into one projection laid out per key/value group (``FusedQKVLinear``: the output
viewed as ``[b, s, kv_heads, heads_per_kv + 2, head_dim]`` and split into the group's query heads, its key and its
value): the layout of issue 57's fourth failure.
"""
import os

import torch
from other_common import (FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
from torchtitan.models.llama3.model import Llama3Model

LIBRARY, VERSION = "torchtitan", version("torchtitan")
SOURCE = "torchtitan/models/llama3/model.py, torchtitan/models/common/attention.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
FUSE_QKV = os.environ.get("TORCHTITAN_FUSE_QKV", "1") == "1"  # torchtitan_llama3_unfused.py: wq, wk, wv apart


def sdpa(layers):
    """torchtitan's own SDPA inner attention in place of flex attention (see the docstring)."""
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def config(fuse_qkv: bool = FUSE_QKV):
    layers = _build_llama3_layers(
        fuse_qkv=fuse_qkv, n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
        rope=ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
        attn_backend="flex")
    sdpa(layers)
    return Llama3Model.Config(
        dim=HIDDEN, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=_output_linear_init(HIDDEN)),
        layers=layers)


def model():
    torch.manual_seed(0)
    net = config().build()
    net.init_states()  # torchtitan's own initialisation (its param_init per module)
    return net


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
