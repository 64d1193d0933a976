"""lucidrains' Routing Transformer (pip ``routing-transformer``, ``routing_transformer.RoutingTransformerLM``), its
own classes unchanged, causal: in each layer 2 of the 4 heads are k-means routed attention (``KmeansAttention``: the
normalized queries and keys assigned to the nearest of ``max_seq_len / window_size = 2`` learned centroids, the
``Kmeans`` buffer ``means``, each cluster's top ``window_size=4`` queries and keys by similarity gathered
(``topk``, ``batched_index_select``), attended causally by their original positions with one learned memory
key/value per cluster, and scattered back (``scatter_mean``)) and 2 are local windowed attention
(``n_local_attn_heads=2``, ``local_attention.LocalAttention``, windows of 4 looking one window back, relative
position embeddings); rotary positions on the routed heads, a GELU feed-forward, pre-norm LayerNorm; dim 64, 4 heads
of 16 (no grouped-query form: ``KV_HEADS_`` is the head count), 2 layers, vocabulary 128, 8 tokens.

The model returns ``(logits, aux_loss)``; the loss is the next-token loss plus the model's commitment loss (the
``Kmeans`` mse of the routed vectors to their centroids, x 1e-4), as its README trains it. Training also moves the
centroids outside the optimizer: ``Kmeans.init`` sets them on the first forward (``torch.randperm`` picks tokens,
then k-means iterations), each training forward stores new means, and a backward hook on the ``RoutingTransformer``
(``update_kmeans_on_backwards``) folds them into the ``means`` buffer by an exponential moving average
(``kmeans_ema_decay=0.999``).
"""
import torch
from other_common import (HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)
from routing_transformer import RoutingTransformerLM

LIBRARY, VERSION = "routing-transformer", version("routing-transformer")
SOURCE = ("routing_transformer/routing_transformer.py (RoutingTransformerLM, RoutingTransformer, SelfAttention, "
          "KmeansAttention, Kmeans, FeedForward), local_attention (LocalAttention)")
HEADS_, KV_HEADS_ = HEADS, HEADS
WINDOW = 4


def model():
    torch.manual_seed(0)
    return RoutingTransformerLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, max_seq_len=SEQ, heads=HEADS,
                                dim_head=HEAD_DIM, window_size=WINDOW, local_attn_window_size=WINDOW,
                                n_local_attn_heads=HEADS // 2, causal=True, ff_mult=2, attn_dropout=0.0,
                                ff_dropout=0.0, attn_layer_dropout=0.0, layer_dropout=0.0)


def loss_fn(output, target):
    """The next-token loss of the logits plus the model's own commitment loss (``output[1]``)."""
    logits, aux_loss = output
    return causal_lm_loss(logits, target) + aux_loss


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
optimizer = sgd
