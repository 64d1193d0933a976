"""lucidrains' Infini-Transformer (``infini_transformer_pytorch.InfiniTransformer``, pip
``infini-transformer-pytorch``), its own classes unchanged, run over the 8 tokens as 2 segments of 4 the way the
library's ``InfiniTransformerWrapper.forward`` runs them (``seq.split(segment_length)``, one call per segment with
``return_new_memories=True``, the new memories passed as the next segment's ``past_memories``, not detached within
the 2 segments): this file's ``InfiniSegments`` is that loop, returning the segments' logits concatenated instead of
the wrapper's loss (the wrapper's ``forward`` computes the cross-entropy and may call ``backward`` itself). Each of the
2 layers: a pre-RMSNorm (``F.normalize * sqrt(dim) * gamma``) ``CausalAttention`` with one fused ``to_qkv``
(``Rearrange('b n (qkv h d) -> qkv b h n d')``: 4 heads of 16), rotary positions from ``rotary-embedding-torch``
(``rotate_queries_with_cached_keys``, positions restarting in every segment), einops ``einsum`` softmax attention under
a ``triu`` causal mask, then the compressive memory (``FastweightMemory``): on the second segment the queries read
the first segment's memory (``elu + 1`` linear attention against ``kv_mem [b, h, 16, 16]`` and ``k_norm [b, h, 16]``)
and mix it in by a learned per-head sigmoid gate ``head_gates``; every segment writes ``einsum(elu(k) + 1, v)`` and
the key sums (``reduce 'sum'``), added to the past ones (eq. 4, no delta rule). A GEGLU-style feed-forward
(``F.gelu(gates) * x`` of one fused ``proj_in`` chunked in two; ff_mult 3, inner ``int(3 * 64 * 2 / 3)`` = 128,
biases), a final RMSNorm and a biased head. dim 64, 2 layers, 4 heads of 16, vocabulary 128, dropout off.

``INFINI_SEGMENTS=1`` runs the 8 tokens as one segment (one call, no memory read: ``head_gates`` then gets no
gradient). ``INFINI_FF_MULT=2`` builds ff_mult 2 (inner ``int(2 * 64 * 2 / 3)`` = 85, odd: the fused ``proj_in`` of
170 chunked in two halves of 85).
"""
import os

import torch
from infini_transformer_pytorch import InfiniTransformer
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from torch import nn

LIBRARY, VERSION = "infini-transformer-pytorch", version("infini-transformer-pytorch")
SOURCE = "infini_transformer_pytorch/infini_transformer.py (InfiniTransformer, CausalAttention, FastweightMemory, " \
         "retrieve_from_kv_memories, FeedForward, RMSNorm), infini_transformer_pytorch/wrapper.py " \
         "(InfiniTransformerWrapper.forward's segment loop, as InfiniSegments here), rotary_embedding_torch"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
FF_MULT = int(os.environ.get("INFINI_FF_MULT", "3"))
SEGMENT = SEQ // int(os.environ.get("INFINI_SEGMENTS", "2"))


class InfiniSegments(nn.Module):
    """``InfiniTransformerWrapper.forward``'s loop over segments, returning logits ``[batch, seq, vocab]``."""

    def __init__(self, transformer: InfiniTransformer, segment_length: int):
        super().__init__()
        self.model = transformer
        self.segment_length = segment_length

    def forward(self, ids):
        logits, past_memories = [], None
        for segment in ids.split(self.segment_length, dim=-1):
            segment_logits, _, past_memories = self.model(segment, past_memories=past_memories,
                                                          return_new_memories=True)
            logits.append(segment_logits)
        return torch.cat(logits, dim=1)


def model():
    torch.manual_seed(0)
    return InfiniSegments(InfiniTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS,
                                            ff_mult=FF_MULT, attn_dropout=0.0, ff_dropout=0.0), SEGMENT)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
