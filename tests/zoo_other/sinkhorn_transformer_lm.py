"""lucidrains' Sinkhorn Transformer (pip ``sinkhorn-transformer``, ``sinkhorn_transformer.SinkhornTransformerLM``),
its own classes unchanged, causal: token embedding plus an axial positional embedding (``AxialPositionalEmbedding``,
axial shape ``(max_seq_len // bucket_size, bucket_size)``), 2 layers of pre-LayerNorm ``SinkhornSelfAttention`` and a
GELU feed-forward (``Chunk`` of 1), a final LayerNorm and a linear head. The attention (``SinkhornCausalAttention``,
every head a Sinkhorn head: ``n_local_attn_heads=0``) rotates the second half of the heads left by
``bucket_size - 1`` positions, cuts the sequence into buckets, scores each query bucket's first cumulative-average
query against the past buckets' summed cumulative-average keys (``CausalAttentionSortNet``: ``cumsum``, ``einsum``),
masks the future (``mask_reordering_matrix``: ``triu_indices`` and an in-place ``masked_fill_``), picks the top
``n_top_buckets=2`` by ``differentiable_topk`` (a Python loop of ``softmax``/``topk``/``scatter_``), gathers those
buckets (with learned null key/values for the first ones) by an ``einsum`` with the soft reordering matrix and
concatenates them to each bucket's own keys/values, then attends with a causal mask and rotates the heads back.
dim 64, 4 heads of 16 (no grouped-query form: ``KV_HEADS_`` is the head count), 2 layers, vocabulary 128,
``max_seq_len=8`` with ``bucket_size=2`` (4 buckets), ``reversible=False`` (the library's default here; its
reversible path, ``sinkhorn_transformer/reversible.py``, is a ``torch.autograd.Function``, ``_ReversibleFunction``).
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from sinkhorn_transformer import SinkhornTransformerLM

LIBRARY, VERSION = "sinkhorn-transformer", version("sinkhorn-transformer")
SOURCE = ("sinkhorn_transformer/sinkhorn_transformer.py (SinkhornTransformerLM, SinkhornTransformer, "
          "SinkhornSelfAttention, SinkhornCausalAttention, CausalAttentionSortNet, differentiable_topk, FeedForward), "
          "sinkhorn_transformer/reversible.py (SequentialSequence), axial_positional_embedding")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
BUCKET = 2


def model():
    torch.manual_seed(0)
    return SinkhornTransformerLM(num_tokens=VOCAB, dim=HIDDEN, max_seq_len=SEQ, depth=LAYERS, heads=HEADS,
                                 dim_head=HEAD_DIM, bucket_size=BUCKET, causal=True, reversible=False,
                                 ff_dropout=0.0, attn_dropout=0.0, attn_layer_dropout=0.0, layer_dropout=0.0,
                                 emb_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
