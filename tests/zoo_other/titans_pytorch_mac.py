"""lucidrains' Titans, memory as context (``titans_pytorch.MemoryAsContextTransformer``, pip ``titans-pytorch``), its
own classes unchanged, trained as its README trains it: ``loss = transformer(seq, return_loss = True)`` on sequences
one token longer than the context (the model splits inputs and labels itself). Layout: the sequence cut into segments
of 4 with 2 learned long-term memory tokens packed after each (``pad_and_segment_with_inverse``,
``pack_with_inverse``), a continuous axial positional embedding, manifold-constrained hyper-connections (4 residual
streams folded into the batch, Sinkhorn-Knopp stream mixing), and per layer a ``NeuralMemory`` (a ``MemoryMLP`` whose
weights are updated per chunk at test time by ``torch.func`` ``vmap(grad(...))`` of an associative-memory loss, with
an associative scan of the surprise momentum), a ``SegmentedAttention`` (2 persistent memory tokens, rotary positions,
value residual from the first layer, a causal block-diagonal mask over the segments) and a GELU feed-forward; RMSNorm
and an untied head; dim 64, 4 heads of 16 (no grouped-query form), 2 layers, ff_mult 3 (a GEGLU of 128: int(dim * mult
* 2 / 3)), vocabulary 128. Installed without its requirements (``tensordict``, ``assoc-scan``, ``hyper-connections``,
``axial-positional-embedding``, ``x-transformers``, added by hand).
"""
import random

import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, returned_loss, sgd, shifted_batch, version
from titans_pytorch import MemoryAsContextTransformer

LIBRARY, VERSION = "titans-pytorch", version("titans-pytorch")
SOURCE = "titans_pytorch/{mac_transformer,neural_memory,memory_models}.py (MemoryAsContextTransformer, NeuralMemory)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form


def mac(**options):
    """The MAC transformer at the table's size (``options``: more of its own, ``titans_pytorch_mac_attn``'s)."""
    torch.manual_seed(0)
    random.seed(0)  # hyper-connections draws each layer's initial stream (random.randrange) while it builds
    return MemoryAsContextTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, segment_len=4,
                                      num_persist_mem_tokens=2, num_longterm_mem_tokens=2, dim_head=HEAD_DIM,
                                      heads=HEADS, ff_mult=3, **options)


def model():
    return mac()


batch = shifted_batch()  # the model cuts inputs and labels from L + 1 tokens itself
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = returned_loss  # the model's own loss (return_loss=True returns the cross-entropy alone)


optimizer = sgd
