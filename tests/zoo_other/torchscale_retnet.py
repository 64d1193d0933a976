"""torchscale's RetNet (Microsoft, ``torchscale.architecture.retnet.RetNetDecoder`` with ``RetNetConfig``, pip
``torchscale``), its own classes unchanged: multi-scale retention (``MultiScaleRetention``: q/k/v/g projections,
xPos-style rotation ``theta_shift``, a per-head decay mask built by ``RetNetRelPos``, a head-wise RMSNorm and a
swish gate), a GLU feed-forward, pre-norm RMSNorm, an ``nn.Embedding`` as ``embed_tokens`` and the decoder's own
untied output projection (built by ``RetNetDecoder`` itself when ``vocab_size > 0``); trained with its parallel
form (no ``incremental_state``, ``chunkwise_recurrent`` off). dim 64, 4 retention heads (key dim 16), a value dim
of 128 (the paper's 2 x dim), a GLU of 128, 2 layers, vocabulary 128; called as ``model(ids)``, it returns
``(logits, {"inner_states", "l_aux", "attn"})``.

Installed with ``--no-deps`` (with ``fairscale==0.4.0``, pure Python): its ``timm==0.6.13`` requirement imports
torchvision, whose only wheels here are CUDA builds that fail to import on CPU torch. torchscale imports timm only
for ``drop_path`` (``torchscale/component/droppath.py``), used only when ``drop_path_rate > 0`` (0 here), so where
timm does not import, timm's ``drop_path`` is provided under its name (``other_common.provide_timm_drop_path``).
"""
import torch
import torch.nn as nn
from other_common import (FFN, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          provide_timm_drop_path, sgd, version)

provide_timm_drop_path()

from torchscale.architecture.config import RetNetConfig  # noqa: E402
from torchscale.architecture.retnet import RetNetDecoder  # noqa: E402

LIBRARY, VERSION = "torchscale", version("torchscale")
SOURCE = "torchscale/architecture/retnet.py (RetNetDecoder, DecoderLayer, RetNetRelPos), " \
         "torchscale/component/{multiscale_retention,gate_linear_unit,rms_norm}.py"
HEADS_, KV_HEADS_ = HEADS, HEADS  # retention heads; no grouped-query form


def model():
    torch.manual_seed(0)
    config = RetNetConfig(vocab_size=VOCAB, decoder_embed_dim=HIDDEN, decoder_value_embed_dim=2 * HIDDEN,
                          decoder_retention_heads=HEADS, decoder_ffn_embed_dim=FFN, decoder_layers=LAYERS,
                          dropout=0.0, activation_dropout=0.0, drop_path_rate=0.0)
    return RetNetDecoder(config, embed_tokens=nn.Embedding(VOCAB, HIDDEN))


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
