"""ESPnet's Transformer language model (``espnet2.lm.transformer_lm.TransformerLM``, pip ``espnet``), its own classes
unchanged, called as ``ESPnetLanguageModel.nll`` calls it, ``y, _ = lm(x, None)``, with a next-token cross-entropy
over its logits (``ESPnetLanguageModel`` itself, which cuts the batch to ``text[:, :text_lengths.max()]`` and writes
``<eos>`` in a Python loop over the lengths, does not export: the cut's length is data-dependent). The LM: an
embedding, ESPnet's transformer ``Encoder`` (``input_layer="linear"``: a Linear, LayerNorm, dropout, ReLU, then scaled
sinusoidal ``PositionalEncoding``), pre-LayerNorm ``EncoderLayer`` blocks in ESPnet's ``MultiSequential``
(``repeat``) with ``MultiHeadedAttention`` (biased q/k/v/out, the causal mask and a padding mask from ``ids != 0``,
filled with the dtype's minimum before the softmax and the masked weights zeroed after) and a ReLU
``PositionwiseFeedForward``; a final LayerNorm and a biased output linear; units 64, 4 heads of 16, 2 layers,
feed-forward 128, vocabulary 128, dropout 0. Installed without its requirements (none is imported by these modules
but ``typeguard``, added by hand).
"""
import torch
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, sgd, token_batch, version
from espnet2.lm.transformer_lm import TransformerLM

LIBRARY, VERSION = "espnet", version("espnet")
SOURCE = "espnet2/lm/transformer_lm.py, espnet/nets/pytorch_backend/transformer/{encoder,encoder_layer,attention}.py"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form


def model():
    torch.manual_seed(0)
    return TransformerLM(VOCAB, pos_enc="sinusoidal", embed_unit=HIDDEN, att_unit=HIDDEN, head=HEADS, unit=FFN,
                         layer=LAYERS, dropout_rate=0.0, positional_dropout_rate=0.0, attention_dropout_rate=0.0)


def batch(step):
    ids, target = token_batch(step)
    return (ids, None), {}, target  # lm(x, None): the second argument (hidden) is unused


example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
