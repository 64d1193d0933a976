"""OpenNMT-py's Transformer language model (pip ``OpenNMT-py``): the decoder-only ``LanguageModel`` over a
``TransformerLMDecoder`` (``onmt/decoders/transformer.py``) with ``onmt.modules.Embeddings``, built by OpenNMT's own
``onmt.model_builder.build_base_model`` from its own option parser (``onmt.opts.train_opts``, then
``ArgumentParser.update_model_opts`` / ``validate_model_opts``) given ``-model_task lm -encoder_type transformer_lm
-decoder_type transformer_lm -position_encoding -share_decoder_embeddings`` and the tiny sizes, then initialised as
``build_model`` initialises a new model (every parameter ``uniform_(-param_init, param_init)``, param_init 0.1: the
generator comes from ``skip_init``). OpenNMT's defaults for the rest: sinusoidal positions, ``scaled-dot-flash``
self-attention (``MultiHeadedAttention``: separate query/key/value linears without bias, ``F.scaled_dot_product_
attention``), pre-norm LayerNorm, ReLU ``PositionwiseFeedForward`` without bias, a final LayerNorm, and the
generator (a ``Linear`` tied to the token embedding).

Training as OpenNMT's trainer does it for ``model_task lm``: ``model(src, tgt, src_len)`` returns the decoder's
output (the decoder builds its own causal mask, and a padding mask from ``src`` equal to the ``<blank>`` index 1),
then ``LossCompute`` applies ``model.generator`` to it and ``CrossEntropyLoss(ignore_index=<blank>,
reduction="sum")``, normalised by the number of target tokens. The generator lives on the model but is called by the
loss, and tracepp's ``loss_fn`` holds no parameters: the wrapper ``LMWithGenerator`` below calls the
``LanguageModel`` and then its generator, as ``Trainer._gradient_accumulation`` and ``LossCompute`` do in turn.
Inputs are ``[batch, seq, 1]`` (one feature: the token), drawn from ids 4..127 (0..3 are ``<unk>``, ``<blank>``,
``<s>``, ``</s>``), no padding, with ``src_len`` all 8.

OpenNMT-py 3.5.1 imports every data transform at package import (``onmt/transforms/__init__.py``): ``terminology.py``
imports spacy and ``clean.py`` fasttext at module level, used only when those transforms run; where they do not
import, an empty module stands in under each name (``pyonmttok``, ``configargparse``, ``six``, ``rapidfuzz``,
``pyahocorasick`` and ``regex`` are installed).
"""
import sys
import types

for _name in ("spacy", "fasttext"):
    try:
        __import__(_name)
    except ImportError:
        sys.modules.setdefault(_name, types.ModuleType(_name))

import pyonmttok  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from onmt import opts  # noqa: E402
from onmt.constants import DefaultTokens  # noqa: E402
from onmt.model_builder import build_base_model  # noqa: E402
from onmt.utils.parse import ArgumentParser  # noqa: E402
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version  # noqa: E402

LIBRARY, VERSION = "OpenNMT-py", version("OpenNMT-py")
SOURCE = ("onmt/model_builder.py (build_base_model, build_model's init), onmt/models/model.py (LanguageModel), "
          "onmt/decoders/transformer.py (TransformerLMDecoder, TransformerLMDecoderLayer), onmt/modules/embeddings.py "
          "(Embeddings, PositionalEncoding), multi_headed_attn.py, position_ffn.py; onmt/utils/loss.py (LossCompute's "
          "generator and CrossEntropyLoss)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention (num_kv 0)
SPECIALS = [DefaultTokens.UNK, DefaultTokens.PAD, DefaultTokens.BOS, DefaultTokens.EOS]


def _opt():
    parser = ArgumentParser()
    opts.train_opts(parser)
    opt, _ = parser.parse_known_args([
        "-model_task", "lm", "-encoder_type", "transformer_lm", "-decoder_type", "transformer_lm",
        "-position_encoding", "-share_decoder_embeddings", "-layers", str(LAYERS), "-hidden_size", str(HIDDEN),
        "-word_vec_size", str(HIDDEN), "-transformer_ff", str(FFN), "-heads", str(HEADS), "-dropout", "0.0",
        "-attention_dropout", "0.0", "-src_vocab", "unused", "-save_data", "unused", "-data", "{}"])
    ArgumentParser.update_model_opts(opt)
    ArgumentParser.validate_model_opts(opt)
    return opt


def _vocabs():
    vocab = pyonmttok.build_vocab_from_tokens([f"t{i}" for i in range(VOCAB - len(SPECIALS))],
                                              special_tokens=SPECIALS)
    return {"src": vocab, "tgt": vocab}


class LMWithGenerator(torch.nn.Module):
    """The trainer's forward (``model(src, tgt, src_len)``) then ``LossCompute``'s ``generator`` call."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, src, src_len):
        dec_out, _attns = self.lm(src, None, src_len)
        return self.lm.generator(dec_out)


def model():
    torch.manual_seed(0)
    opt, vocabs = _opt(), _vocabs()
    assert len(vocabs["tgt"]) == VOCAB
    lm = build_base_model(opt, vocabs)
    for param in lm.parameters():  # build_model, for a new model
        torch.nn.init.uniform_(param, -opt.param_init, opt.param_init)
    return LMWithGenerator(lm)


def batch(step):
    ids, target = token_batch(step, vocab=VOCAB - len(SPECIALS))
    ids, target = ids + len(SPECIALS), target + len(SPECIALS)
    return (ids.unsqueeze(-1), torch.full((ids.shape[0],), ids.shape[1])), {}, target


example_inputs, example_kwargs, example_target = examples_of(batch)
_PAD = _vocabs()["tgt"][DefaultTokens.PAD]  # 1


def loss_fn(output, target):
    flat = target.reshape(-1)
    loss = F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), flat, ignore_index=_PAD, reduction="sum")
    return loss / flat.ne(_PAD).sum()  # normalization "tokens"


optimizer = sgd
