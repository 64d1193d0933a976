"""labml-nn's vanilla transformer (pip ``labml-nn``, the annotated implementations of nn.labml.ai), assembled as its
``transformers/basic/autoregressive_experiment.py`` assembles it through ``TransformerConfigs`` (defaults): token
embedding times sqrt(d_model) plus fixed sinusoidal positions (``EmbeddingsWithPositionalEncoding``, a buffer),
an ``Encoder`` of pre-norm ``TransformerLayer``s (LayerNorm; ``MultiHeadAttention``: separate query/key/value
``PrepareForMultiHeadAttention`` linears with biases, ``einsum`` scores, ``masked_fill`` by a boolean mask, softmax
over the key dim; ReLU ``FeedForward``), a final LayerNorm, and a ``Generator`` linear head. labml's layout is
**sequence first**: ids ``[seq, batch]``, logits ``[seq, batch, vocab]`` (its ``transpose_batch`` collates so), trained
with ``CrossEntropyLoss`` over ``output.view(-1, n_tokens)`` (``experiments/nlp_autoregression.py``): ``batch_dim = 1``.

The experiment's wrapper ``AutoregressiveTransformer`` (which builds the causal ``subsequent_mask`` in its forward
and returns ``(logits, None)``) lives in ``autoregressive_experiment.py``, whose import chain
(``experiments/nlp_autoregression.py`` -> ``helpers/datasets.py``) needs torchvision; it is copied here unchanged.
Configuration: d_model 64, 4 heads of 16, d_ff 128, 2 layers, vocabulary 128, dropout 0.
labml-nn 0.5.1 needs labml < 0.5 (pip ``labml==0.4.168``): its ``mha.py`` calls ``labml.tracker.debug``,
which labml 0.5 removed (``AttributeError: module 'labml.tracker' has no attribute 'debug'``).
"""
import torch
import torch.nn.functional as F
from labml_nn.transformers.feed_forward import FeedForward
from labml_nn.transformers.mha import MultiHeadAttention
from labml_nn.transformers.models import Encoder, EmbeddingsWithPositionalEncoding, Generator, TransformerLayer
from labml_nn.transformers.utils import subsequent_mask
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version
from torch import nn

LIBRARY, VERSION = "labml-nn", version("labml-nn")
SOURCE = ("labml_nn/transformers/models.py (EmbeddingsWithPositionalEncoding, TransformerLayer, Encoder, Generator), "
          "mha.py (MultiHeadAttention), feed_forward.py (FeedForward), utils.py (subsequent_mask); the wrapper is "
          "basic/autoregressive_experiment.py's AutoregressiveTransformer, copied")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention
batch_dim = 1  # [seq, batch]: the samples on dim 1 of the ids and of the target


class AutoregressiveTransformer(nn.Module):
    """labml_nn/transformers/basic/autoregressive_experiment.py, unchanged (comments dropped)."""

    def __init__(self, encoder: Encoder, src_embed: nn.Module, generator: nn.Module):
        super().__init__()
        self.src_embed = src_embed
        self.encoder = encoder
        self.generator = generator
        self.mask = None

    def forward(self, x: torch.Tensor):
        if self.mask is None or self.mask.size(0) != len(x):
            self.mask = subsequent_mask(len(x)).to(x.device)
        x = self.src_embed(x)
        x = self.encoder(x, self.mask)
        x = self.generator(x)
        return x, None


def model():
    torch.manual_seed(0)
    # TransformerConfigs' defaults: 'mha' attention, ReLU FeedForward (bias_gate unused), 'fixed_pos' embedding
    layer = TransformerLayer(d_model=HIDDEN, self_attn=MultiHeadAttention(HEADS, HIDDEN, dropout_prob=0.0),
                             src_attn=None, feed_forward=FeedForward(HIDDEN, FFN, dropout=0.0, activation=nn.ReLU()),
                             dropout_prob=0.0)
    return AutoregressiveTransformer(Encoder(layer, LAYERS), EmbeddingsWithPositionalEncoding(HIDDEN, VOCAB),
                                     Generator(VOCAB, HIDDEN))


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as transpose_batch collates


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    logits = output[0]  # nlp_autoregression.CrossEntropyLoss over the model's first output
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


optimizer = sgd
