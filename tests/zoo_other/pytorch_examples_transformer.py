"""PyTorch's own language-model example (github.com/pytorch/examples ``word_language_model/model.py``, vendored
unchanged in ``pytorch_examples_wlm/``: not on PyPI): ``TransformerModel``, a subclass of ``nn.Transformer`` that uses
its ``nn.TransformerEncoder`` (``nn.TransformerEncoderLayer``: ``nn.MultiheadAttention`` with one fused
``in_proj_weight``, post-norm LayerNorm, ReLU MLP) under a causal mask of ``log(tril(ones))``, sinusoidal positions
(a buffer), and ``log_softmax`` logits. Its layout is PyTorch's default, **sequence first**: the input is ``[seq,
batch]`` token ids and the output ``[seq, batch, vocab]``, as the example's ``batchify`` lays the corpus out, trained
as its ``main.py`` trains it (``NLLLoss`` over ``output.view(-1, ntokens)``); ``batch_dim = 1`` tells tracepp so.

Configuration: 4 heads over a width of 64 (16 each), a feed-forward of 128, 2 encoder layers, vocabulary 128.
``nn.Transformer`` also builds its 6 decoder layers, which this model never calls (their parameters take no
gradient). The example passes its ``dropout`` to the positions only, and ``nn.Transformer``'s layers keep their
default 0.1: the file sets every ``nn.Dropout`` to 0 and each attention's ``dropout`` to 0 after building (dropout off,
as every file here has it).
"""
import torch
import torch.nn.functional as F
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch
from pytorch_examples_wlm.model import TransformerModel

LIBRARY, VERSION = "pytorch/examples (word_language_model)", "77f55b9 (vendored)"
SOURCE = ("pytorch/examples word_language_model/model.py (TransformerModel, PositionalEncoding); torch.nn "
          "(Transformer, TransformerEncoder, TransformerEncoderLayer, MultiheadAttention)")
HEADS_, KV_HEADS_ = HEADS, HEADS
batch_dim = 1  # [seq, batch]: the samples on dim 1 of the ids and of the target


def model():
    torch.manual_seed(0)
    net = TransformerModel(VOCAB, HIDDEN, HEADS, 2 * HIDDEN, LAYERS, dropout=0.0)
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0
    return net


def batch(step):
    ids, target = token_batch(step)
    return (ids.t().contiguous(),), {}, target.t().contiguous()  # [seq, batch], as batchify lays the data out


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.nll_loss(output.view(-1, VOCAB), target.reshape(-1))  # main.py's criterion


optimizer = sgd
