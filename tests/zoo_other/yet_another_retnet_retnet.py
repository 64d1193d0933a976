"""yet-another-retnet's RetNet (``yet_another_retnet.RetNet``, pip ``yet-another-retnet``), a pure-PyTorch RetNet, its
own classes unchanged, trained as its README trains it: ``loss = model(inputs, labels)``, the loss computed inside the
model (``forward_parallel``, then ``nn.CrossEntropyLoss`` over every position). Layout: pre-LayerNorm decoder layers
(``RetNetDecoderLayer``, deep-copied into a ``ModuleList``), each a ``MultiScaleRetention`` (separate biased q/k/v
projections rearranged to ``b h n d``, xPos-style ``_theta_shift`` of q and k (a ``torch.jit.script`` function),
a per-head decay mask built from ``torch.arange`` and cached by ``functools.lru_cache``, ``einsum`` retention with no
softmax, a ``GroupNorm`` of ``num_heads`` groups over ``(b n) (h d)``, a swish gate ``g_proj`` and ``out_proj``) and a
swish feed-forward (``linear1``, ``linear2``); an untied biased head; d_model 64, 4 heads of 16 (no grouped-query
form), 2 layers, feed-forward 128, vocabulary 128, dropout 0.
"""
import torch
from other_common import FFN, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, ids_targets_batch, sgd, version
from yet_another_retnet.retnet import RetNet

LIBRARY, VERSION = "yet-another-retnet", version("yet-another-retnet")
SOURCE = "yet_another_retnet/{retnet,retention}.py (RetNet, RetNetDecoder, RetNetDecoderLayer, MultiScaleRetention)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form


def model():
    torch.manual_seed(0)
    return RetNet(num_tokens=VOCAB, d_model=HIDDEN, nhead=HEADS, num_layers=LAYERS, dropout=0.0,
                  dim_feedforward=FFN)


batch = ids_targets_batch
example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    return output  # the model's own loss (its forward returns the cross-entropy alone)


optimizer = sgd
