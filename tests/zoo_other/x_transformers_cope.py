"""x-transformers' decoder with contextual positions and selective attention (lucidrains,
``x_transformers.TransformerWrapper`` + ``Decoder``, pip ``x-transformers``), its own classes unchanged: CoPE
contextual position encoding (``attn_use_cope``, ``CoPE``: positions counted as a reversed cumulative sum of the
sigmoid gates of the causal scores, clamped at ``attn_cope_max_pos=8``, interpolated between learned per-position
logits and added to the scores), selective attention (``attn_selective``: a ReLU of one head's scores, shifted and
cumulatively summed along the queries, subtracted from every head's scores), a per-head value gate
(``attn_gate_value_heads``: the heads scaled by a sigmoid of ``to_v_head_gate``), per-head RMS-normalized queries and
keys (``attn_qk_rmsnorm``), the input embedding reinjected into every layer (``reinject_input``:
``reinject_input_proj`` added to each layer's input), pre-norm LayerNorm, no absolute or rotary positions,
grouped-query attention (4 query heads, 2 key/value heads), the attention written out (``attn_flash=False``); dim
64, 2 layers, vocabulary 128.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from x_transformers import Decoder, TransformerWrapper

LIBRARY, VERSION = "x-transformers", version("x-transformers")
SOURCE = ("x_transformers/x_transformers.py (TransformerWrapper, Decoder, Attention, MultiheadRMSNorm), "
          "x_transformers/attend.py (Attend, CoPE, selective_attn)")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ * 8, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=HIDDEN, depth=LAYERS, heads=HEADS, attn_kv_heads=KV_HEADS, attn_dim_head=HEAD_DIM,
                            attn_use_cope=True, attn_cope_max_pos=8, attn_selective=True, attn_gate_value_heads=True,
                            attn_qk_rmsnorm=True, reinject_input=True,
                            attn_flash=False, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
