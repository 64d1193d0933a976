"""torchtune's Phi-3 (``torchtune.models.phi3.phi3``, the component builder ``phi3_mini`` calls; pip ``torchtune``
0.6.1), its own classes unchanged: ``TransformerDecoder``, ``MultiHeadAttention`` with multi-head attention (4
key/value heads, as Phi-3-mini's 32 of 32) and ``Phi3RotaryPositionalEmbeddings`` (rotate-half rotary positions with
one cos/sin cache sliced per call, unlike Llama 3's interleaved pairs), ``FeedForward`` (SwiGLU, ``phi3_mlp``),
``RMSNorm``, an untied head. torchtune's builder keeps q, k, v and gate, up as separate projections (its checkpoint
converter splits Phi-3's fused ``qkv_proj`` and ``gate_up_proj``). Dim 64, 4 heads of 16, 2 layers, an MLP of 128,
vocabulary 128.
"""
import torch
from other_common import (FFN, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)

LIBRARY, VERSION = "torchtune", version("torchtune")
SOURCE = ("torchtune/models/phi3/{_component_builders,_position_embeddings}.py, "
          "torchtune/modules/{transformer,attention,feed_forward,rms_norm}.py")
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    from torchtune.models.phi3 import phi3

    torch.manual_seed(0)
    return phi3(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS, embed_dim=HIDDEN,
                intermediate_dim=FFN, max_seq_len=SEQ * 8, attn_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
