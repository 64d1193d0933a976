"""lucidrains' autoregressive mixture-of-attention transformer (``mixture_of_attention.transformer.Transformer``,
pip ``mixture-of-attention``), its own classes unchanged: a token embedding plus a learned absolute position
embedding, ``LAYERS`` residual blocks of ``MixtureOfAutoregressiveAttention`` and a pre-RMSNorm GELU feed-forward
(mult 2), a final RMSNorm and an untied head. Each ``MixtureOfAutoregressiveAttention``: a causal
``local_attention.LocalMHA`` (window 4, 4 heads of 16) over every token, plus, for the sequence cut into windows of 4
(the first window has none), two ``colt5_attention.CoordinateDescentRouter``s (``use_triton=False``: the pure-PyTorch
coordinate descent, ``topk``, gathers) picking 2 queries of each window and 2 key/values of the earlier windows per
each of 2 attention experts, an ``Attention`` whose experts are grouped ``Conv1d(kernel 1, groups=2)`` projections
(learned null key/values, rotary positions gathered at the routed indices, ``F.scaled_dot_product_attention``), its
output scaled by the router scores and ``scatter_add``-ed back, unrouted positions filled by a per-expert learned null
token, summed over experts and added to the local output. dim 64, 2 layers, 4 heads of 16, 2 experts, seq_len 8,
vocabulary 128.

With 2 experts (the default here) colt5-attention 0.11.2's ``CoordinateDescentRouter`` (``transformer_block.py``:
``x = repeat(x, 'b ... -> (b r) ...', r = num_routes)``, then ``batched_gather(x, selected_indices)`` indexing that
``[(b r), n, d]`` tensor with ``arange(b)``) gathers sample ``i``'s routed tokens from row ``i`` of the repeated
tensor, i.e. from sample ``i // 2``: a sample's output depends on the other samples of its batch, so a split into
microbatches cannot match the whole batch's step. ``MOA_EXPERTS=1`` builds one expert per router, where that gather is
right.

The routers pick queries over a whole window of 4 (the query router's top-k sees every token of its window), so a
token's output can depend on later tokens of its window: the library's autoregressive form routes per window.
"""
import os

import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, \
    version
from mixture_of_attention.transformer import Transformer

LIBRARY, VERSION = "mixture-of-attention", version("mixture-of-attention")
SOURCE = "mixture_of_attention/transformer.py (Transformer, RMSNorm, FeedForward), " \
         "mixture_of_attention/mixture_of_attention.py (MixtureOfAutoregressiveAttention, Attention), " \
         "mixture_of_attention/attend.py (Attend), mixture_of_attention/rotary_emb.py (RotaryEmbedding), " \
         "local_attention (LocalMHA), colt5_attention (CoordinateDescentRouter)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form
EXPERTS = int(os.environ.get("MOA_EXPERTS", "2"))


def model():
    torch.manual_seed(0)
    return Transformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, seq_len=SEQ, local_attn_window_size=4,
                       num_routed_queries=2, num_routed_key_values=2, num_experts=EXPERTS, dim_head=HEAD_DIM,
                       heads=HEADS, ff_mult=2, use_triton=False)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
