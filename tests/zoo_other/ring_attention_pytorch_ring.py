"""lucidrains' RingTransformer (``ring_attention_pytorch.RingTransformer``, pip ``ring-attention-pytorch``), its own
classes unchanged, as a causal language model on one machine: ``ring_attn=False`` (a ring of 1: no sequence sharding,
no ``torch.distributed`` ring passes, whether or not a process group exists), ``use_cuda_kernel=False`` and
``force_regular_attn=False``, so each ``RingAttention`` runs the library's pure-PyTorch blockwise flash attention
``ring_flash_attn`` (``RingFlashAttentionFunction``, a ``torch.autograd.Function`` whose ``forward`` and hand-written
``backward`` are under ``@torch.no_grad()``: buckets of 4 tokens, running row maxima and sums updated in place
with ``mul_``/``add_``/``copy_``, a causal ``triu`` mask filled with ``masked_fill_`` on the diagonal bucket,
``fill_`` above it, grouped-query keys/values expanded with einops ``repeat``; its backward is FlashAttention-2's
algorithm 2 with ``reduce(... 'sum')`` over the query groups). Each layer: ``to_qkv`` a pre-RMSNorm (lucidrains'
``F.normalize * sqrt(dim) * gamma``) and one fused ``Linear(64, 4*16 + 2*2*16)`` split into 4 query heads and 2
key/value heads (``num_grouped_query_heads=2``), rotary positions (``RingRotaryEmbedding``, computed once in the
transformer's forward and passed to every layer), ``to_out``; a pre-RMSNorm GELU feed-forward (mult 2, biases);
residuals; a final RMSNorm and an untied head. dim 64, 2 layers, 4 heads of 16, 2 key/value heads, bucket 4,
vocabulary 128.

``RING_REGULAR_ATTN=1`` builds it with ``force_regular_attn=True``: each layer then runs the library's
``default_attention`` (plain einsum softmax attention, ``torch.where`` causal mask, autograd's own backward) in place
of ``ring_flash_attn``.
"""
import os

import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, \
    sgd, version
from ring_attention_pytorch import RingTransformer

LIBRARY, VERSION = "ring-attention-pytorch", version("ring-attention-pytorch")
SOURCE = "ring_attention_pytorch/ring_attention.py (RingTransformer, RingAttention, RingRotaryEmbedding, RMSNorm, " \
         "FeedForward), ring_attention_pytorch/ring_flash_attention.py (ring_flash_attn, RingFlashAttentionFunction), " \
         "ring_attention_pytorch/ring.py (null_ring_pass)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
BUCKET = SEQ // 2
REGULAR_ATTN = os.environ.get("RING_REGULAR_ATTN", "0") == "1"


def model():
    torch.manual_seed(0)
    return RingTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, causal=True, dim_head=HEAD_DIM, heads=HEADS,
                           ff_mult=2, num_grouped_query_heads=HEADS // KV_HEADS, bucket_size=BUCKET, ring_attn=False,
                           force_regular_attn=REGULAR_ATTN, use_cuda_kernel=False)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
