"""labml-nn's RoPE transformer (pip ``labml-nn``), assembled as ``transformers/rope/experiment.py`` assembles it:
the basic experiment's ``AutoregressiveTransformer`` with ``'transformer.src_embed': 'no_pos'`` (a bare
``nn.Embedding``) and ``'transformer.encoder_attn': 'rotary'``, i.e. ``RotaryPEMultiHeadAttention(n_heads, d_model,
1.)`` (rotary positions on all 16 features of each head's queries and keys, a ``RotaryPositionalEmbeddings`` per
projection whose cos/sin tables are plain attributes built on the first call from ``x.shape[0]``), pre-norm
``TransformerLayer``s (LayerNorm, ReLU ``FeedForward``), a final LayerNorm and a ``Generator`` head. **Sequence first**
(ids ``[seq, batch]``): ``batch_dim = 1``; ``CrossEntropyLoss`` over ``output.view(-1, n_tokens)``.

``AutoregressiveTransformer`` (builds ``subsequent_mask`` in its forward, returns ``(logits, None)``) is copied
unchanged from ``basic/autoregressive_experiment.py``, whose imports need torchvision.
Configuration: d_model 64, 4 heads of 16, d_ff 128, 2 layers, vocabulary 128, dropout 0.
labml-nn 0.5.1 needs labml < 0.5 (pip ``labml==0.4.168``): its ``mha.py`` calls ``labml.tracker.debug``,
which labml 0.5 removed (``AttributeError: module 'labml.tracker' has no attribute 'debug'``).
"""
import torch
import torch.nn.functional as F
from labml_nn.transformers.feed_forward import FeedForward
from labml_nn.transformers.models import Encoder, Generator, TransformerLayer
from labml_nn.transformers.rope import RotaryPEMultiHeadAttention
from labml_nn.transformers.utils import subsequent_mask
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version
from torch import nn

LIBRARY, VERSION = "labml-nn", version("labml-nn")
SOURCE = ("labml_nn/transformers/rope/__init__.py (RotaryPEMultiHeadAttention, RotaryPositionalEmbeddings), "
          "models.py (TransformerLayer, Encoder, Generator), feed_forward.py; the wrapper is "
          "basic/autoregressive_experiment.py's AutoregressiveTransformer, copied")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention
batch_dim = 1  # [seq, batch]


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
    layer = TransformerLayer(d_model=HIDDEN, self_attn=RotaryPEMultiHeadAttention(HEADS, HIDDEN, 1.),
                             src_attn=None, feed_forward=FeedForward(HIDDEN, FFN, dropout=0.0, activation=nn.ReLU()),
                             dropout_prob=0.0)
    return AutoregressiveTransformer(Encoder(layer, LAYERS), nn.Embedding(VOCAB, HIDDEN), Generator(VOCAB, HIDDEN))


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as transpose_batch collates


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    logits = output[0]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


optimizer = sgd
