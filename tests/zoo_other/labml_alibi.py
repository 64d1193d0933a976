"""labml-nn's ALiBi GPT (pip ``labml-nn``), assembled as ``transformers/alibi/experiment.py`` assembles it: the
``GPT`` wrapper of ``transformers/gpt`` (its ``_init_weights``: every Linear and Embedding weight N(0, 0.02), biases
zero) over ``TransformerConfigs`` option ``'GPT_ALiBi'``: ``src_embed = 'no_pos'`` (a bare ``nn.Embedding``), every
attention ``AlibiMultiHeadAttention`` (labml's ``MultiHeadAttention`` plus linear biases from
``get_alibi_biases(n_heads, mask)``: the mask's ``cumsum`` times per-head slopes, cached on the module at the first
call), a GELU ``FeedForward``, pre-norm LayerNorm ``TransformerLayer``s, a final LayerNorm, a ``Generator`` head.
**Sequence first** (ids ``[seq, batch]``): ``batch_dim = 1``; ``CrossEntropyLoss`` over ``output.view(-1, n_tokens)``.

``GPT`` and ``_init_weights`` live in ``transformers/gpt/__init__.py``, whose imports
(``experiments/nlp_autoregression.py`` -> ``helpers/datasets.py``) need torchvision: both are copied here unchanged.
Configuration: d_model 64, 4 heads of 16, d_ff 128, 2 layers, vocabulary 128, dropout 0 (the experiment's 0.1 off).
labml-nn 0.5.1 needs labml < 0.5 (pip ``labml==0.4.168``): its ``mha.py`` calls ``labml.tracker.debug``,
which labml 0.5 removed (``AttributeError: module 'labml.tracker' has no attribute 'debug'``).
"""
import torch
import torch.nn.functional as F
from labml_nn.transformers.alibi import AlibiMultiHeadAttention
from labml_nn.transformers.feed_forward import FeedForward
from labml_nn.transformers.models import Encoder, Generator, TransformerLayer
from labml_nn.transformers.utils import subsequent_mask
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version
from torch import nn

LIBRARY, VERSION = "labml-nn", version("labml-nn")
SOURCE = ("labml_nn/transformers/alibi/__init__.py (AlibiMultiHeadAttention, get_alibi_biases, get_slopes), "
          "models.py (TransformerLayer, Encoder, Generator), feed_forward.py; the wrapper and init are "
          "gpt/__init__.py's GPT and _init_weights, copied")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention
batch_dim = 1  # [seq, batch]


class GPT(nn.Module):
    """labml_nn/transformers/gpt/__init__.py, unchanged (comments dropped)."""

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


def _init_weights(module):
    """labml_nn/transformers/gpt/__init__.py, unchanged."""
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        return
    module.weight.data.normal_(mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        module.bias.data.zero_()


def model():
    torch.manual_seed(0)
    layer = TransformerLayer(d_model=HIDDEN, self_attn=AlibiMultiHeadAttention(HEADS, HIDDEN, dropout_prob=0.0),
                             src_attn=None, feed_forward=FeedForward(HIDDEN, FFN, dropout=0.0, activation=nn.GELU()),
                             dropout_prob=0.0)
    m = GPT(Encoder(layer, LAYERS), nn.Embedding(VOCAB, HIDDEN), Generator(VOCAB, HIDDEN))
    m.apply(_init_weights)
    return m


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as transpose_batch collates


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    logits = output[0]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


optimizer = sgd
