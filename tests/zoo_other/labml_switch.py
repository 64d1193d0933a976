"""labml-nn's Switch Transformer (pip ``labml-nn``), assembled as ``transformers/switch/experiment.py`` assembles it
(its ``switch_transformer`` option and ``main()``'s overrides: 4 experts, ``drop_tokens=True``, ``capacity_factor
1.2``, ``is_scale_prob=True``): ``SwitchTransformer`` of ``SwitchTransformerLayer``s (pre-norm LayerNorm, labml's
``MultiHeadAttention``, a ``SwitchFeedForward``: a ``switch`` linear router, softmax, top-1 by ``torch.max``, the
tokens of each expert found by ``torch.eq(routes, i).nonzero()``, each expert a ReLU ``FeedForward`` applied to
``x[indexes, :]`` and scattered back by index assignment, tokens past an expert's capacity (``int(1.2 * tokens /
4)``, over the **whole** batch) dropped at random by ``torch.randperm`` and passed through, the output scaled by the
route probability), a final LayerNorm; the experiment's ``AutoregressiveModel`` (a bare ``nn.Embedding``, the
causal ``subsequent_mask`` built in its forward, a linear head) returns ``(logits, counts, route_prob, n_dropped,
route_prob_max)``. The loss is the experiment's ``step``: cross-entropy plus 0.01 x the load-balancing loss
``n_experts * (counts / total * route_prob / total).sum()``. **Sequence first** (ids ``[seq, batch]``):
``batch_dim = 1``.

``AutoregressiveModel`` lives in ``switch/experiment.py``, whose imports (``helpers/trainer.py``,
``experiments/nlp_autoregression.py`` -> ``helpers/datasets.py``) need torchvision: it is copied here unchanged, and
the loss is ``Configs.step``'s lines. Configuration: d_model 64, 4 heads of 16, d_ff 128, 2 layers, 4 experts,
vocabulary 128, dropout 0.
labml-nn 0.5.1 needs labml < 0.5 (pip ``labml==0.4.168``): its ``mha.py`` calls ``labml.tracker.debug``,
which labml 0.5 removed (``AttributeError: module 'labml.tracker' has no attribute 'debug'``).
"""
import torch
import torch.nn.functional as F
from labml_nn.transformers.feed_forward import FeedForward
from labml_nn.transformers.mha import MultiHeadAttention
from labml_nn.transformers.switch import SwitchFeedForward, SwitchTransformer, SwitchTransformerLayer
from labml_nn.transformers.utils import subsequent_mask
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch, version
from torch import nn

LIBRARY, VERSION = "labml-nn", version("labml-nn")
SOURCE = ("labml_nn/transformers/switch/__init__.py (SwitchTransformer, SwitchTransformerLayer, SwitchFeedForward), "
          "mha.py, feed_forward.py; the wrapper is switch/experiment.py's AutoregressiveModel, copied, and the loss "
          "its Configs.step")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention
batch_dim = 1  # [seq, batch]
N_EXPERTS, LOAD_BALANCING_LOSS_COEF = 4, 0.01


class AutoregressiveModel(nn.Module):
    """labml_nn/transformers/switch/experiment.py, unchanged (comments dropped)."""

    def __init__(self, n_vocab: int, d_model: int, transformer: nn.Module):
        super().__init__()
        self.src_embed = nn.Embedding(n_vocab, d_model)
        self.transformer = transformer
        self.generator = nn.Linear(d_model, n_vocab)
        self.mask = None

    def forward(self, x: torch.Tensor):
        if self.mask is None or self.mask.size(0) != len(x):
            self.mask = subsequent_mask(len(x)).to(x.device)
        x = self.src_embed(x)
        res, counts, route_prob, n_dropped, route_prob_max = self.transformer(x, self.mask)
        res = self.generator(res)
        return res, counts, route_prob, n_dropped, route_prob_max


def model():
    torch.manual_seed(0)
    transformer = SwitchTransformer(
        SwitchTransformerLayer(d_model=HIDDEN,
                               attn=MultiHeadAttention(HEADS, HIDDEN, 0.0),
                               feed_forward=SwitchFeedForward(capacity_factor=1.2,
                                                              drop_tokens=True,
                                                              is_scale_prob=True,
                                                              n_experts=N_EXPERTS,
                                                              expert=FeedForward(HIDDEN, FFN, 0.0),
                                                              d_model=HIDDEN),
                               dropout_prob=0.0),
        LAYERS)
    return AutoregressiveModel(VOCAB, HIDDEN, transformer)


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as transpose_batch collates


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    """switch/experiment.py ``Configs.step``: cross-entropy (nlp_autoregression.CrossEntropyLoss) plus the
    load-balancing loss."""
    output, counts, route_prob, n_dropped, route_prob_max = output
    cross_entropy_loss = F.cross_entropy(output.view(-1, output.shape[-1]), target.view(-1))
    total = counts.sum(dim=-1, keepdims=True)
    route_frac = counts / total
    route_prob = route_prob / total
    load_balancing_loss = N_EXPERTS * (route_frac * route_prob).sum()
    return cross_entropy_loss + LOAD_BALANCING_LOSS_COEF * load_balancing_loss


optimizer = sgd
