"""torchtune's Llama 3 (``torchtune.models.llama3.llama3``, the component builder every Llama 3 size calls; pip
``torchtune`` 0.6.1), its own classes unchanged: ``TransformerDecoder``, ``MultiHeadAttention`` (separate q/k/v
projections, grouped-query attention, rotary positions), ``FeedForward`` (SwiGLU), ``RMSNorm``; dim 64, 4 query
heads, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128.
"""
import os

import torch
from other_common import (FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "torchtune", version("torchtune")
SOURCE = "torchtune/modules/{transformer,attention,feed_forward,rms_norm,position_embeddings}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
BUILDER = os.environ.get("TORCHTUNE_BUILDER", "llama3")


def model():
    from torchtune.models.llama3 import llama3
    from torchtune.models.qwen2 import qwen2

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=HIDDEN,
                  max_seq_len=SEQ * 8, intermediate_dim=FFN, attn_dropout=0.0)
    if BUILDER == "qwen2":  # q/k/v biases, a head tied to the embedding (Qwen2-0.5B)
        return qwen2(**common, tie_word_embeddings=True)
    return llama3(**common)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
