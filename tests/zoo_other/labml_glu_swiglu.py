"""labml-nn's GLU-variants transformer (pip ``labml-nn``), assembled as ``transformers/glu_variants/simple.py``'s
``Trainer`` assembles it (its configuration-free version) with ``glu_variant = 'SwiGLU'``: ``FeedForward(d_model,
d_ff, dropout, nn.SiLU(), True, False, False, False)`` (gated, no biases: ``layer2(silu(layer1(x)) * linear_v(x))``),
labml's ``MultiHeadAttention``, pre-norm LayerNorm ``TransformerLayer``s in an ``Encoder`` (final LayerNorm), fixed
sinusoidal positions (``EmbeddingsWithPositionalEncoding``), an ``nn.Linear`` head; its ``AutoregressiveModel`` builds
the causal ``subsequent_mask`` in its forward and returns the logits alone. **Sequence first** (ids ``[seq,
batch]``, ``transpose_batch``): ``batch_dim = 1``; ``nn.CrossEntropyLoss()`` over ``output.view(-1,
output.shape[-1])`` and ``target.view(-1)``, as ``Trainer.train`` computes it.

``AutoregressiveModel`` lives in ``glu_variants/simple.py``, whose imports (``experiments/nlp_autoregression.py`` ->
``helpers/datasets.py``) need torchvision: it is copied here unchanged. Configuration: d_model 64, 4 heads of 16,
d_ff 128, 2 layers, vocabulary 128, dropout 0.
labml-nn 0.5.1 needs labml < 0.5 (pip ``labml==0.4.168``): its ``mha.py`` calls ``labml.tracker.debug``,
which labml 0.5 removed (``AttributeError: module 'labml.tracker' has no attribute 'debug'``).
"""
import torch
import torch.nn.functional as F
from labml_nn.transformers.feed_forward import FeedForward
from labml_nn.transformers.mha import MultiHeadAttention
from labml_nn.transformers.models import Encoder, EmbeddingsWithPositionalEncoding, TransformerLayer
from labml_nn.transformers.utils import subsequent_mask
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version
from torch import nn

LIBRARY, VERSION = "labml-nn", version("labml-nn")
SOURCE = ("labml_nn/transformers/feed_forward.py (FeedForward, gated), mha.py (MultiHeadAttention), models.py "
          "(EmbeddingsWithPositionalEncoding, TransformerLayer, Encoder); the wrapper is glu_variants/simple.py's "
          "AutoregressiveModel, copied")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention
batch_dim = 1  # [seq, batch]


class AutoregressiveModel(nn.Module):
    """labml_nn/transformers/glu_variants/simple.py, unchanged (comments dropped)."""

    def __init__(self, src_embed: nn.Module, encoder: Encoder, generator: nn.Module):
        super().__init__()
        self.src_embed = src_embed
        self.encoder = encoder
        self.generator = generator
        self.src_mask = None

    def forward(self, src: torch.Tensor):
        if self.src_mask is None or self.src_mask.size(0) != len(src):
            self.src_mask = subsequent_mask(len(src)).to(src.device)
        res = self.encoder(self.src_embed(src), self.src_mask)
        return self.generator(res)


def model():
    torch.manual_seed(0)
    ffn = FeedForward(HIDDEN, FFN, 0.0, nn.SiLU(), True, False, False, False)  # simple.py's 'SwiGLU'
    mha = MultiHeadAttention(HEADS, HIDDEN, 0.0)
    transformer_layer = TransformerLayer(d_model=HIDDEN, self_attn=mha, src_attn=None, feed_forward=ffn,
                                         dropout_prob=0.0)
    return AutoregressiveModel(EmbeddingsWithPositionalEncoding(HIDDEN, VOCAB), Encoder(transformer_layer, LAYERS),
                               nn.Linear(HIDDEN, VOCAB))


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as transpose_batch collates


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.cross_entropy(output.view(-1, output.shape[-1]), target.view(-1))  # Trainer.train's loss


optimizer = sgd
