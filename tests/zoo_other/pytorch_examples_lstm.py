"""PyTorch's own recurrent language model (github.com/pytorch/examples ``word_language_model/model.py``, vendored
unchanged in ``pytorch_examples_wlm/``: not on PyPI): ``RNNModel('LSTM')``, an embedding, a 2-layer ``nn.LSTM`` and
a linear decoder, its forward ``(input, hidden) -> (log_softmax(decoded.view(-1, ntoken)), hidden)``. Its layout is
PyTorch's default, **sequence first**: the ids ``[seq, batch]`` and the initial state ``(h, c)`` ``[layers, batch,
hidden]`` (``init_hidden(bsz)``), both with the samples on dim 1, declared by ``batch_dim = 1``; trained as its
``main.py`` trains it (``NLLLoss`` over the flattened output, the state zeroed at every batch here: each step a new
batch of sequences). Width 64, 2 layers, vocabulary 128, dropout 0, untied.
"""
import torch
import torch.nn.functional as F
from other_common import HIDDEN, LAYERS, VOCAB, examples_of, sgd, token_batch
from pytorch_examples_wlm.model import RNNModel

LIBRARY, VERSION = "pytorch/examples (word_language_model)", "77f55b9 (vendored)"
SOURCE = "pytorch/examples word_language_model/model.py (RNNModel); torch.nn.LSTM"
HEADS_, KV_HEADS_ = None, None
batch_dim = 1  # [seq, batch]: the samples on dim 1 of the ids, the state and the target


def model():
    torch.manual_seed(0)
    return RNNModel("LSTM", VOCAB, HIDDEN, HIDDEN, LAYERS, dropout=0.0)


def batch(step):
    ids, target = token_batch(step)
    ids, target = ids.t().contiguous(), target.t().contiguous()  # as batchify lays the corpus out
    state = (torch.zeros(LAYERS, ids.shape[1], HIDDEN), torch.zeros(LAYERS, ids.shape[1], HIDDEN))
    return (ids, state), {}, target


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.nll_loss(output[0], target.reshape(-1))  # main.py's criterion over output.view(-1, ntokens)


optimizer = sgd
