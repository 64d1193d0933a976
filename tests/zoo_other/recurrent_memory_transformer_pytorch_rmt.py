"""lucidrains' Recurrent Memory Transformer (``recurrent_memory_transformer_pytorch.RecurrentMemoryTransformer``
driven by ``RecurrentMemoryTransformerWrapper``, pip ``recurrent-memory-transformer-pytorch``), its own classes
unchanged. The wrapper cuts the 8 tokens into 2 segments of 4 (``split``) and runs the transformer once per segment
in a Python loop, carrying memory tokens between them: each segment is packed as [4 read-memory tokens (the previous
segment's write memories plus a learned ``read_memory_emb``; the learned embedding alone on the first segment),
the segment's tokens, 4 learned write-memory tokens] (einops ``pack``), under a custom mask (causal over the tokens,
memories visible to all), and the write memories it outputs become the next segment's read memories (gradients flow
through them). Each of the 2 layers is pre-RMSNorm (``nn.RMSNorm``) attention with separate ``to_q`` and fused
``to_kv``, learned null key/values, value residual learning (layers after the first mix their values with the first
layer's by a sigmoid gate ``learned_value_residual_mix``), einsum attention (``Attend``, ``use_flash=False``), and a
GEGLU feed-forward; both wrapped in hyper-connections (pip ``hyper-connections``: 4 residual streams, the library's
default, with learned static and dynamic stream mixing); learned absolute positions, ``frac_gradient`` on the
embeddings. dim 64, 4 heads of 16, ff_mult 3 (GEGLU inner 128), vocabulary 128. ``model(ids)`` is one call per batch
(memories start fresh): it returns ``(logits [batch, 8, vocab], last write memories)``; XL memories are returned by
the transformer but the wrapper's forward does not pass them back in.

``model()`` seeds Python's ``random`` as well as torch's: hyper-connections picks each branch's initial residual stream
(the one-hot ``static_alpha``) by ``random.randrange`` where no ``layer_index`` is given
(``hyper_connections/hyper_connections.py:215``), and RMT gives none, so an unseeded build differs from rank to rank.
"""
import random

import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from recurrent_memory_transformer_pytorch import RecurrentMemoryTransformer, RecurrentMemoryTransformerWrapper

LIBRARY, VERSION = "recurrent-memory-transformer-pytorch", version("recurrent-memory-transformer-pytorch")
SOURCE = "recurrent_memory_transformer_pytorch/recurrent_memory_transformer.py (RecurrentMemoryTransformerWrapper, " \
         "RecurrentMemoryTransformer, Attention, FeedForward), recurrent_memory_transformer_pytorch/attend.py, " \
         "hyper_connections/hyper_connections.py"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
SEGMENT, MEMORY = SEQ // 2, 4


def model():
    torch.manual_seed(0)
    random.seed(0)
    return RecurrentMemoryTransformerWrapper(RecurrentMemoryTransformer(
        HIDDEN, num_tokens=VOCAB, depth=LAYERS, num_memory_tokens=MEMORY, seq_len=SEGMENT, causal=True,
        dim_head=HEAD_DIM, heads=HEADS, ff_mult=3, attn_dropout=0.0, ff_dropout=0.0, use_flash_attn=False))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
