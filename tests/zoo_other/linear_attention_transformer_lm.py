"""lucidrains' linear attention transformer (``linear_attention_transformer.LinearAttentionTransformerLM``, pip
``linear-attention-transformer``), its own classes unchanged, as a causal language model: fixed sinusoidal
absolute positions plus a per-layer rotary embedding read from a sinusoid buffer (``use_rotary_emb``:
``FixedPositionalEmbedding``, ``apply_rotory_pos_emb``), pre-LayerNorm blocks run by its ``SequentialSequence``
(``args_route``), separate ``to_q``/``to_k``/``to_v`` projections and a biased ``to_out``; of each layer's 4 heads of
16, the first 2 are local windowed softmax attention (``n_local_attn_heads=2``, ``local-attention``'s
``LocalAttention``, window 4, causal, looking one window back) and the other 2 causal linear attention
(``causal_linear_attn`` with bucket 1: softmax over features for q, ``exp`` of k, ``cumsum`` of the ``k v^T`` outer
products and of the k sums over the sequence); the heads are split off with ``split_at_index`` and rejoined with
``torch.cat`` over the head dim; a GELU feed-forward of 4x with biases (``Chunk`` of 1), a final LayerNorm and an
untied head with a bias; dim 64, 2 layers, context 64, vocabulary 128. Installed with ``--no-deps`` plus
``linformer`` and ``product-key-memory`` (imported at the top, unused here). ``LINEAR_ATTENTION_REVERSIBLE=1``
builds its reversible form (``linear_attention_transformer_reversible.py``).
"""
import os

import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from linear_attention_transformer import LinearAttentionTransformerLM

LIBRARY, VERSION = "linear-attention-transformer", version("linear-attention-transformer")
SOURCE = "linear_attention_transformer/linear_attention_transformer.py (LinearAttentionTransformerLM, " \
         "LinearAttentionTransformer, SelfAttention, causal_linear_attn, FeedForward, FixedPositionalEmbedding), " \
         "linear_attention_transformer/reversible.py (SequentialSequence), local_attention/local_attention.py"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form
LOCAL_HEADS, WINDOW = 2, 4
REVERSIBLE = os.environ.get("LINEAR_ATTENTION_REVERSIBLE", "0") == "1"


def model():
    torch.manual_seed(0)
    return LinearAttentionTransformerLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, max_seq_len=SEQ * 8, heads=HEADS,
                                        dim_head=HEAD_DIM, causal=True, n_local_attn_heads=LOCAL_HEADS,
                                        local_attn_window_size=WINDOW, use_rotary_emb=True, use_axial_pos_emb=False,
                                        reversible=REVERSIBLE)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
