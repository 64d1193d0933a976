"""SpeechBrain's Transformer language model (pip ``speechbrain``, ``speechbrain/lobes/models/transformer/
TransformerLM.py``), built and trained as its LibriSpeech LM recipe does (``recipes/LibriSpeech/LM/hparams/
transformer.yaml`` and ``train.py``): ``TransformerLM(vocab, d_model, nhead, num_encoder_layers, num_decoder_layers=0,
d_ffn, dropout=0.0, activation=GELU, normalize_before=False)``, called as ``model(tokens_bos)``; the recipe's
``compute_forward`` applies ``speechbrain.nnet.activations.Softmax(apply_log=True)`` and its ``compute_objectives``
``speechbrain.nnet.losses.nll_loss(pred, tokens_eos, length=tokens_len)`` (relative lengths, 1.0 for full rows).

The model builds its own masks in its forward (``make_masks``): the causal ``get_lookahead_mask`` (a float mask of
``-inf`` above the diagonal) and ``get_key_padding_mask(src, pad_idx=0)``, a boolean mask of the tokens equal to 0
(the recipe's tokenizer keeps index 0 for blank/pad, and the recipe's first input token is its bos 1): so the batch
draws tokens from 1..127 (``token_batch`` over 127 ids, plus one), no position padded, as the recipe's full-length
rows are. Layout: batch first, ``[batch, time]``; fixed sinusoidal positions (a buffer), post-norm encoder layers of
SpeechBrain's ``MultiheadAttention`` (``torch.nn.MultiheadAttention``, fused ``in_proj_weight``) and
``PositionalwiseFeedForward``, then ``output_proj`` (Linear, LayerNorm, Linear). Configuration: d_model 64, 4 heads
of 16, d_ffn 128, 2 encoder layers, 0 decoder layers, vocabulary 128, dropout 0.

SpeechBrain 1.1.2 imports ``torchaudio`` at package import (``speechbrain/utils/torch_audio_backend.py``, only to
read its version for a backend warning); PyPI has no torchaudio for torch 2.13, so where it does not import, an
empty module stands in under its name before speechbrain is imported (none of the code used here touches it).
"""
import sys
import types

try:
    import torchaudio  # noqa: F401
except ImportError:
    sys.modules.setdefault("torchaudio", types.ModuleType("torchaudio"))

import torch  # noqa: E402
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version  # noqa: E402
from speechbrain.lobes.models.transformer.TransformerLM import TransformerLM  # noqa: E402
from speechbrain.nnet.activations import Softmax  # noqa: E402
from speechbrain.nnet.losses import nll_loss  # noqa: E402

LIBRARY, VERSION = "speechbrain", version("speechbrain")
SOURCE = ("speechbrain/lobes/models/transformer/TransformerLM.py (TransformerLM), Transformer.py "
          "(TransformerInterface, TransformerEncoder, TransformerEncoderLayer, NormalizedEmbedding, PositionalEncoding, "
          "get_lookahead_mask, get_key_padding_mask), nnet/attention.py (MultiheadAttention, PositionalwiseFeedForward), "
          "nnet/losses.py (nll_loss)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention

_log_softmax = Softmax(apply_log=True)  # the recipe's log_softmax


def model():
    torch.manual_seed(0)
    return TransformerLM(vocab=VOCAB, d_model=HIDDEN, nhead=HEADS, num_encoder_layers=LAYERS, num_decoder_layers=0,
                         d_ffn=FFN, dropout=0.0, activation=torch.nn.GELU, normalize_before=False)


def batch(step):
    ids, target = token_batch(step, vocab=VOCAB - 1)
    return (ids + 1,), {}, target + 1  # ids 1..127: 0 is the recipe's pad/blank, masked as padding by the model


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    pred = _log_softmax(output)  # compute_forward
    length = torch.ones(target.shape[0], device=target.device)  # relative lengths (the batch's, on its device): full
    return nll_loss(pred, target, length=length)  # compute_objectives


optimizer = sgd
