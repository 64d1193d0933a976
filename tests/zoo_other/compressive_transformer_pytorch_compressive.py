"""lucidrains' Compressive Transformer (pip ``compressive-transformer-pytorch``,
``compressive_transformer_pytorch.CompressiveTransformer``), its own classes unchanged: token embedding, 2 layers each
of pre-LayerNorm ``SelfAttention`` (separate ``to_q`` and fused ``to_kv``, einsum scores plus a learned relative
position term: ``einsum('bhid,hjd->bhij', q, pos_emb)`` realigned by ``shift`` (zero pads, ``view``s and a slice),
a causal mask from ``triu_`` filled in place with ``masked_fill_``) and a GELU feed-forward, each wrapped in the
library's default GRU-gated residual (``GRUGating``: an ``nn.GRUCell`` over the flattened tokens, the block's output as
input and its input as hidden state), and a linear head. One segment per call: ``model(ids)`` passes no memories (they
start empty: ``torch.empty(layers, batch, 0, dim)``, rolled by ``enhanced_recurrence``), so the memory queue fills
with this segment's hidden states, nothing is old enough to compress (the ``ConvCompress`` conv and the reconstruction
loss stay unused) and the returned auxiliary loss is 0. It returns ``(logits [batch, 8, vocab], Memory(mem, cmem)
detached, aux_loss)``: logits first. dim 64, 4 heads of 16 (no grouped-query form), 2 layers, vocabulary 128,
``seq_len=8``, ``mem_len=8`` (its assert: at least ``seq_len``), ``cmem_len=2`` (at least ``mem_len // cmem_ratio``),
``cmem_ratio=4``.
"""
import torch
from compressive_transformer_pytorch import CompressiveTransformer
from other_common import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "compressive-transformer-pytorch", version("compressive-transformer-pytorch")
SOURCE = ("compressive_transformer_pytorch/compressive_transformer_pytorch.py (CompressiveTransformer, SelfAttention, "
          "GRUGating, PreNorm, FeedForward, ConvCompress, shift, queue_fifo)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form


def model():
    torch.manual_seed(0)
    return CompressiveTransformer(num_tokens=VOCAB, dim=HIDDEN, seq_len=SEQ, depth=LAYERS, heads=HEADS, mem_len=SEQ,
                                  cmem_len=2, cmem_ratio=4, attn_dropout=0.0, ff_dropout=0.0,
                                  attn_layer_dropout=0.0, reconstruction_attn_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
