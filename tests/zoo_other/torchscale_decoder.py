"""torchscale's Transformer decoder (Microsoft, ``torchscale.architecture.decoder.Decoder`` with ``DecoderConfig``,
pip ``torchscale``), its own classes unchanged, at its defaults but the sizes: pre-norm LayerNorm with Magneto's
sub-LayerNorm (``subln=True``, the default: a LayerNorm over the attention output before ``out_proj`` and one over
the FFN's hidden before ``fc2``, and the subln init scaling), ``MultiheadAttention`` (separate q/k/v/out projections
with biases, ``bmm`` over batch x heads, an additive causal mask built per layer with ``torch.triu``), a GELU
``FeedForwardNetwork``, and torchscale's own relative positions, xPos (``xpos_rel_pos=True``: ``XPOS`` rotates and
scales q and k; without it, or fairseq's ``embed_positions``, the decoder has no positions), an ``nn.Embedding`` as
``embed_tokens`` and the decoder's own untied output projection; dim 64, 4 heads of 16, an FFN of 128, 2 layers,
vocabulary 128; called as ``model(ids)``, it returns ``(logits, {"inner_states", "l_aux", "attn"})``.
``TORCHSCALE_SUBLN=0`` turns Magneto's sub-LayerNorm off (``subln=False``: a plain pre-norm decoder).

Installed with ``--no-deps`` (with ``fairscale==0.4.0``), without apex (torchscale falls back to
``torch.nn.LayerNorm``) and without timm: see ``torchscale_retnet.py``; timm's ``drop_path`` is provided where timm
does not import (``other_common.provide_timm_drop_path``; ``drop_path_rate`` is 0).
"""
import os

import torch
import torch.nn as nn
from other_common import (FFN, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          provide_timm_drop_path, sgd, version)

provide_timm_drop_path()

from torchscale.architecture.config import DecoderConfig  # noqa: E402
from torchscale.architecture.decoder import Decoder  # noqa: E402

LIBRARY, VERSION = "torchscale", version("torchscale")
SOURCE = "torchscale/architecture/decoder.py (Decoder, DecoderLayer), " \
         "torchscale/component/{multihead_attention,feedforward_network,xpos_relative_position}.py"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention; no grouped-query form
SUBLN = os.environ.get("TORCHSCALE_SUBLN", "1") == "1"


def model():
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, decoder_embed_dim=HIDDEN, decoder_attention_heads=HEADS,
                           decoder_ffn_embed_dim=FFN, decoder_layers=LAYERS, xpos_rel_pos=True, subln=SUBLN,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, drop_path_rate=0.0)
    return Decoder(config, embed_tokens=nn.Embedding(VOCAB, HIDDEN))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
