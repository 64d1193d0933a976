"""torchtune's Gemma 2 (``torchtune.models.gemma2.gemma2``, the component builder ``gemma2_2b`` calls; pip
``torchtune`` 0.6.1), its own classes unchanged: ``Gemma2Attention`` (separate q/k/v projections, grouped-query
attention by ``expand`` + ``reshape``, rotary positions, queries scaled in place, ``q.mul_``, explicit
``matmul``/tanh softcapping/``softmax`` attention, a sliding window built with ``triu`` * ``tril`` on every other
layer), ``GemmaRMSNorm`` before and after attention and MLP (``sa_scale``, ``mlp_scale``), a GeGLU MLP
(``gemma_mlp``), ``GemmaNormEmbeddings`` (scaled by sqrt(hidden)), ``Gemma2FinalNorm`` (torchtune softcaps the final
norm's output, the hidden state, not the logits), a head tied to the embedding (``TiedLinear``). Caps as
``gemma2_2b`` passes them (30 on attention scores, 50 at the end); a sliding window of 4 tokens (shorter than the
sequence of 8, so it masks); dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128.
"""
import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)

LIBRARY, VERSION = "torchtune", version("torchtune")
SOURCE = ("torchtune/models/gemma2/{_component_builders,_attention}.py, torchtune/models/gemma/*.py, "
          "torchtune/modules/{transformer,feed_forward,tied_linear,position_embeddings}.py")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
WINDOW = 4


def model():
    from torchtune.models.gemma2 import gemma2

    torch.manual_seed(0)
    return gemma2(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, num_kv_heads=KV_HEADS,
                  embed_dim=HIDDEN, intermediate_dim=FFN, max_seq_len=SEQ * 8, attn_dropout=0.0, norm_eps=1e-6,
                  hidden_capping_value=30.0, final_capping_value=50.0, sliding_window_size=WINDOW)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
