"""labml-nn's AFT-local transformer (pip ``labml-nn``, An Attention Free Transformer), assembled as
``transformers/aft/experiment.py`` assembles it: ``TransformerConfigs`` with ``encoder_attn = AFTLocal(d_model,
seq_len, local_window_size)`` (query/key/value linears, a learned ``[seq_len, seq_len]`` position bias times a fixed
local band mask -- an ``nn.Parameter`` with ``requires_grad=False`` -- filled with -inf where the causal mask is 0,
``exp(key - key.max over the sequence)``, ``exp(pos_bias - its max over keys)``, two ``einsum``s over the sequence,
``sigmoid(query) * num / den``, an output linear), fixed sinusoidal positions (``'fixed_pos'``), pre-norm LayerNorm
``TransformerLayer``s with a ReLU ``FeedForward``, a final LayerNorm, a ``Generator`` head, in the experiment's
``AutoregressiveTransformer`` (``subsequent_mask`` built in its forward, ``(logits, None)``). **Sequence first**
(ids ``[seq, batch]``): ``batch_dim = 1``; ``CrossEntropyLoss`` over ``output.view(-1, n_tokens)``.

``AutoregressiveTransformer`` lives in ``aft/experiment.py``, whose imports need torchvision: it is copied here
unchanged. Configuration: d_model 64, d_ff 128, 2 layers, vocabulary 128, dropout 0; ``seq_len`` 8 (the position
bias is sized by it) and a local window of 4 (the experiment's 32 of 256 tokens would cover nothing at 8).
labml-nn 0.5.1 needs labml < 0.5 (pip ``labml==0.4.168``): its ``mha.py`` calls ``labml.tracker.debug``,
which labml 0.5 removed (``AttributeError: module 'labml.tracker' has no attribute 'debug'``).
"""
import torch
import torch.nn.functional as F
from labml_nn.transformers.aft import AFTLocal
from labml_nn.transformers.feed_forward import FeedForward
from labml_nn.transformers.models import Encoder, EmbeddingsWithPositionalEncoding, Generator, TransformerLayer
from labml_nn.transformers.utils import subsequent_mask
from other_common import FFN, HIDDEN, LAYERS, SEQ, VOCAB, examples_of, sgd, token_batch, version
from torch import nn

LIBRARY, VERSION = "labml-nn", version("labml-nn")
SOURCE = ("labml_nn/transformers/aft/__init__.py (AFTLocal), models.py (EmbeddingsWithPositionalEncoding, "
          "TransformerLayer, Encoder, Generator), feed_forward.py; the wrapper is aft/experiment.py's "
          "AutoregressiveTransformer, copied")
HEADS_, KV_HEADS_ = None, None  # attention free: no heads
batch_dim = 1  # [seq, batch]
LOCAL_WINDOW = 4


class AutoregressiveTransformer(nn.Module):
    """labml_nn/transformers/aft/experiment.py, unchanged (comments dropped)."""

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
    layer = TransformerLayer(d_model=HIDDEN, self_attn=AFTLocal(HIDDEN, SEQ, LOCAL_WINDOW), src_attn=None,
                             feed_forward=FeedForward(HIDDEN, FFN, dropout=0.0, activation=nn.ReLU()),
                             dropout_prob=0.0)
    return AutoregressiveTransformer(Encoder(layer, LAYERS), EmbeddingsWithPositionalEncoding(HIDDEN, VOCAB),
                                     Generator(VOCAB, HIDDEN))


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as transpose_batch collates


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    logits = output[0]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


optimizer = sgd
