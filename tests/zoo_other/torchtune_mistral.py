"""torchtune's Mistral (``torchtune.models.mistral.mistral``, the component builder ``mistral_7b`` calls; pip
``torchtune`` 0.6.1), its own classes unchanged: ``TransformerDecoder``, ``MultiHeadAttention`` (separate q/k/v
projections without biases, grouped-query attention, as Mistral-7B's 32 query heads to 8; torchtune's builder has no
sliding window), ``RotaryPositionalEmbeddings``, ``FeedForward`` (SwiGLU, ``mistral_mlp``), ``RMSNorm``, an untied
head; the head size is dim / heads, as the builder derives it. Dim 64, 4 query heads of 16, 2 key/value heads, 2
layers, an MLP of 128, vocabulary 128.
"""
import torch
from other_common import (FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "torchtune", version("torchtune")
SOURCE = ("torchtune/models/mistral/_component_builders.py, "
          "torchtune/modules/{transformer,attention,feed_forward,rms_norm,position_embeddings}.py")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    from torchtune.models.mistral import mistral

    torch.manual_seed(0)
    return mistral(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=HIDDEN,
                   intermediate_dim=FFN, max_seq_len=SEQ * 8, attn_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
