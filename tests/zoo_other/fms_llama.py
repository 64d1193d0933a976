"""IBM foundation-model-stack's LLaMA (``fms.models.llama.LLaMA``, pip ``ibm-fms``), its own classes unchanged:
``LLaMAHeadless`` (embedding, ``LLaMABlock`` list, ``LayerNormParameterized`` as RMSNorm), ``MultiHeadAttention``
with the library's default fused q/k/v projection (``FusedQKV``: one ``qkv_fused`` linear split into
``[heads*d, kv_heads*d, kv_heads*d]``), grouped-query attention (kvheads 2), ``RotaryEmbedding`` (real-valued,
freqs cached in a plain dict, not a buffer), ``GatedLinearUnit`` (SwiGLU, fused ``wg1_fused`` by default),
``LinearClassificationHead``; dim 64, 4 query heads, 2 key/value heads, 2 layers, an MLP of 128 (grow factor 2,
multiple_of 1), vocabulary 128, dropout off. Initialised as ``fms.models.get_model`` does for a model without a
checkpoint: ``reset_parameters()`` then ``post_init()``.
"""
import torch
from other_common import (FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "fms", version("ibm-fms")
SOURCE = "fms/models/llama.py, fms/modules/{attention,feedforward,positions,layernorm,head}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    from fms.models.llama import LLaMA, LLaMAConfig

    torch.manual_seed(0)
    config = LLaMAConfig(src_vocab_size=VOCAB, emb_dim=HIDDEN, nheads=HEADS, kvheads=KV_HEADS, nlayers=LAYERS,
                         hidden_grow_factor=FFN / HIDDEN, multiple_of=1, p_dropout=0.0,
                         max_expected_seq_len=SEQ * 8)
    net = LLaMA(config)
    net.reset_parameters()  # fms's own random init, as get_model does without a checkpoint
    net.post_init()
    return net


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
