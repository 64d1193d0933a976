"""torchtune's Gemma (``torchtune.models.gemma.gemma``, the component builder ``gemma_2b`` calls; pip ``torchtune``
0.6.1), its own classes unchanged: ``TransformerDecoder``, ``MultiHeadAttention`` with multi-query attention (one
key/value head, as Gemma-2B's 8 query heads to 1, broadcast to the query heads by ``expand``), separate q/k/v
projections, rotary positions, a GeGLU MLP (``gemma_mlp``), ``GemmaRMSNorm`` (unit offset), ``GemmaNormEmbeddings``
(scaled by sqrt(hidden)), a head tied to the embedding (``TiedLinear``); dim 64, 4 query heads of 16, 2 layers, an
MLP of 128, vocabulary 128.
"""
import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "torchtune", version("torchtune")
SOURCE = ("torchtune/models/gemma/{_component_builders,rms_norm,gemma_norm_embedding}.py, "
          "torchtune/modules/{transformer,attention,feed_forward,tied_linear,position_embeddings}.py")
HEADS_, KV_HEADS_ = HEADS, 1


def model():
    from torchtune.models.gemma import gemma

    torch.manual_seed(0)
    return gemma(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, num_kv_heads=1,
                 embed_dim=HIDDEN, intermediate_dim=FFN, max_seq_len=SEQ * 8, attn_dropout=0.0, norm_eps=1e-6)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
