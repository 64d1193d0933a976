"""lucidrains' Reformer (pip ``reformer-pytorch``, ``reformer_pytorch.ReformerLM``), its own classes unchanged,
causal: LSH self-attention (``LSHSelfAttention`` / ``LSHAttention``: queries and keys shared (``toqk``), each
head's keys hashed by a random rotation into ``seq / bucket_size`` buckets, ``n_hashes=2`` rounds, the positions
sorted by bucket (``sort_key_val``), chunked, each chunk attending to itself and the chunk before, the rounds
combined by ``logsumexp``), rotary positions per head (the default ``FixedPositionalEmbedding(dim_head)``), a
chunked GELU feed-forward (``ff_chunks``), and the reversible residual (``ReversibleSequence``: two half streams,
``ReversibleBlock``'s autograd function recomputes each block's input in the backward pass from its output, with the
saved RNG state); dim 64, 4 heads of 16 (no grouped-query form: ``KV_HEADS_`` is the head count), 2 layers,
vocabulary 128, 8 tokens.

LSH attention needs the sequence divisible by ``2 * bucket_size`` and an even bucket count, and falls back to full
attention when the sequence is no longer than ``full_attn_thres`` (default ``bucket_size``): ``bucket_size=2`` gives 4
buckets of 2 at 8 tokens, so the LSH path runs. The hash draws its random rotations with ``torch.randn`` in every
forward (``LSHAttention.hash_vectors``), one draw for the whole batch: the model is stochastic, as with dropout.
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from reformer_pytorch import ReformerLM

LIBRARY, VERSION = "reformer-pytorch", version("reformer-pytorch")
SOURCE = ("reformer_pytorch/reformer_pytorch.py (ReformerLM, Reformer, LSHSelfAttention, LSHAttention, "
          "FixedPositionalEmbedding, Chunk, FeedForward), reformer_pytorch/reversible.py (ReversibleSequence, "
          "ReversibleBlock, Deterministic)")
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    return ReformerLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, max_seq_len=SEQ, heads=HEADS, dim_head=HEAD_DIM,
                      bucket_size=2, n_hashes=2, causal=True, ff_mult=2, lsh_dropout=0.0, ff_dropout=0.0,
                      post_attn_dropout=0.0, layer_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
