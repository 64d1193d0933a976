"""A causal language model on PyTorch's own transformer modules, written as PyTorch's tutorials and its
``word_language_model`` example write one: ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer``s
(``nn.MultiheadAttention`` with one fused ``in_proj_weight``, post-norm, ReLU MLP, dropout off) under the causal mask
``nn.Transformer.generate_square_subsequent_mask`` (which ``nn.TransformerEncoder`` compares with a causal mask of its
own to choose a kernel: a comparison of values ``torch.export`` cannot trace, turned off while tracepp traces),
learned positions, an untied head; hidden 64, 4 heads, 2 layers, 16 tokens, a batch of 4.

``SEQ_FIRST=1``: PyTorch's default layout, sequence first (``batch_first=False``): the ids ``[seq, batch]``, the
output ``[seq, batch, vocab]`` and the target ``[seq, batch]``, declared to tracepp by ``batch_dim = 1``;
``NO_BATCH_DIM=1`` leaves the declaration out, and tracepp would cut the sequences into microbatches: the split
stops, naming the module (``tracepp/sequence_first.py``).
"""
import os

import torch
import torch.nn as nn
from lib_style import D, HEADS, SEQ, VOCAB, loss_fn as _batch_first_loss, sgd, token_batch  # noqa: F401

SEQ_FIRST = os.environ.get("SEQ_FIRST") == "1"
if SEQ_FIRST and os.environ.get("NO_BATCH_DIM") != "1":
    batch_dim = 1


class EncoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, 1 if SEQ_FIRST else D, D if SEQ_FIRST else 1)
                                .reshape((SEQ, 1, D) if SEQ_FIRST else (1, SEQ, D)) * 0.02)
        layer = nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=2 * D, dropout=0.0, batch_first=not SEQ_FIRST)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        length = ids.shape[0 if SEQ_FIRST else 1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        x = self.embed(ids) + (self.pos[:length] if SEQ_FIRST else self.pos[:, :length])
        return self.head(self.encoder(x, mask=mask))


def model():
    torch.manual_seed(0)
    return EncoderLM()


def batch(step):
    (ids,), kwargs, target = token_batch(step)
    if SEQ_FIRST:
        return (ids.t().contiguous(),), kwargs, target.t().contiguous()
    return (ids,), kwargs, target


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    if SEQ_FIRST:  # as labml's and PyTorch's word_language_model's loops write it: views of the whole batch's tensors
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
    return _batch_first_loss(logits, target)  # a mean over every position: the layout does not matter


optimizer = sgd
