"""lucidrains' MEGABYTE (``MEGABYTE_pytorch.MEGABYTE``, pip ``MEGABYTE-pytorch``), its own classes unchanged: a
two-stage multiscale byte decoder. The global transformer runs over patches (each patch's token embeddings
concatenated, LayerNorm, projected: ``token_embs[1]``), with a learned start token prepended; its outputs are
projected to one vector per position of the next patch (``to_next_transformer_projections``) and added to the local
transformer's inputs, which run over each patch separately (batch folded to ``(b m)``). Both stages are pre-RMSNorm
(``torch.norm``-based) blocks with RWKV-style token shift (half the channels shifted one position by ``F.pad``),
causal multi-head attention written as ``einsum`` with a ``triu`` mask (its ``Attend``, ``flash=False``), rotary
positions (``rel_pos``), a separate ``to_q`` and fused ``to_kv``, and a GELU feed-forward. dims (64, 64), depths
(2, 2), patches of 2 (max_seq_len (4, 2): 8 tokens), 4 heads of 16, ff_mult 2, vocabulary 128; called as
``model(ids)`` with ids ``[batch, seq]`` it returns next-token logits ``[batch, seq, vocab]``.

``MEGABYTE_FLASH=1`` builds it with ``flash_attn=True``: the same attention through
``F.scaled_dot_product_attention(is_causal=True)`` inside ``torch.nn.attention.sdpa_kernel`` (``attend.py``).
"""
import os

import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from MEGABYTE_pytorch import MEGABYTE

LIBRARY, VERSION = "MEGABYTE-pytorch", version("MEGABYTE-pytorch")
SOURCE = "MEGABYTE_pytorch/megabyte.py (MEGABYTE, Transformer, Attention, RMSNorm, token_shift), " \
         "MEGABYTE_pytorch/attend.py (Attend)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
PATCH = 2
FLASH = os.environ.get("MEGABYTE_FLASH", "0") == "1"


def model():
    torch.manual_seed(0)
    return MEGABYTE(num_tokens=VOCAB, dim=(HIDDEN, HIDDEN), depth=(2, 2), max_seq_len=(SEQ // PATCH, PATCH),
                    dim_head=HEAD_DIM, heads=HEADS, ff_mult=2, attn_dropout=0.0, ff_dropout=0.0, rel_pos=True,
                    flash_attn=FLASH)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
