"""lucidrains' Native Sparse Attention (pip ``native-sparse-attention-pytorch``), its own decoder unchanged:
``native_sparse_attention_pytorch.transformer.Transformer`` with ``use_sparse_attn=True`` (its dense ``Attention``
branch cannot run: ``Transformer.forward`` calls every layer's attention with ``cache=``/``return_cache=``, which
``Attention.forward`` does not take), causal, no flex attention and no Triton kernel (CPU). Each layer:
``SparseAttention`` (pre ``nn.RMSNorm``, one fused ``to_qkv`` split into 4 query heads of 16 and 2 key/value heads;
three branches: attention over compressed blocks (keys/values cut into overlapping windows by ``nn.ZeroPad2d`` +
``nn.Unfold``, intra-block positions added by ``einx``, each window compressed by an MLP, a learned memory key/value,
a causal block mask), fine attention over the top-n blocks chosen from the compressed attention scores (averaged
over each key/value group, ``topk``, keys/values gathered by ``gather``, a block-causal mask) and a sliding window
(``local_attention.LocalAttention``), mixed per head by a sigmoid gate from ``to_strategy_combine``), then a GELU
feed-forward with pre ``nn.RMSNorm``; rotary from ``rotary_embedding_torch``. dim 64, 2 layers, vocabulary 128;
windows sized for 8 tokens: sliding window 2, compress blocks of 4 at stride 2, selection blocks of 2, 2 selected.

``NSA_DIFF_TOPK=1`` (``native_sparse_attention_pytorch_nsa_difftopk.py``): the other selection,
``use_diff_topk=True`` (the selected keys scaled by a straight-through gate) with ``query_heads_share_selected_kv=
False`` (each query head picks its own blocks, keys/values tiled per query head).
"""
import os

import torch
from native_sparse_attention_pytorch.transformer import Transformer
from other_common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "native-sparse-attention-pytorch", version("native-sparse-attention-pytorch")
SOURCE = "native_sparse_attention_pytorch/transformer.py (Transformer), " \
         "native_sparse_attention_pytorch/native_sparse_attention.py (SparseAttention, attend), " \
         "local_attention (LocalAttention), rotary_embedding_torch (RotaryEmbedding)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
DIFF_TOPK = os.environ.get("NSA_DIFF_TOPK", "0") == "1"


def model():
    torch.manual_seed(0)
    sparse = dict(sliding_window_size=2, compress_block_size=4, compress_block_sliding_stride=2,
                  selection_block_size=2, num_selected_blocks=2)
    if DIFF_TOPK:
        sparse.update(use_diff_topk=True, query_heads_share_selected_kv=False)
    return Transformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS,
                       kv_heads=KV_HEADS, ff_expansion_factor=2., use_sparse_attn=True, causal=True,
                       sparse_attn_kwargs=sparse)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
