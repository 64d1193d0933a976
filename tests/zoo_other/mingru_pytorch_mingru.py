"""lucidrains' minGRU language model (``minGRU_pytorch.minLM``, pip ``minGRU-pytorch``), its own classes unchanged:
pre-RMSNorm (``torch.nn.RMSNorm``) residual blocks of a causal depthwise + pointwise conv (``enable_conv``:
``CausalDepthWiseConv1d``, ``F.pad`` left then ``Conv1d(groups=dim)`` and ``Conv1d(kernel 1)``), a ``minGRU`` (one
fused ``to_hidden_and_gate`` projection, chunked in two, expansion 1.5 with an output projection; its parallel form
is the log-space Heinsen scan ``heinsen_associative_scan_log``: ``cumsum`` of the log-coefficients and
``logcumsumexp`` over the sequence, then ``exp``; ``log_g`` is a ``torch.where`` of two branches) and a GELU MLP
with biases; a final RMSNorm and an untied head; dim 64, 2 layers, ff_mult 2, vocabulary 128. No heads: the
recurrence is channel-wise.

``MINGRU_LSTM=1`` builds the same model with ``minLSTM`` (``use_lstm``: one fused projection of hidden, forget and
input gates, chunked in three, the same log-space scan) instead: ``mingru_pytorch_minlstm.py``.
"""
import os

import torch
from other_common import HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from minGRU_pytorch.minLM import minLM

LIBRARY, VERSION = "minGRU-pytorch", version("minGRU-pytorch")
LSTM = os.environ.get("MINGRU_LSTM", "0") == "1"
SOURCE = "minGRU_pytorch/minLM.py (minLM, CausalDepthWiseConv1d, FeedForward), " + (
    "minGRU_pytorch/minLSTM.py (minLSTM), minGRU_pytorch/minGRU.py (heinsen_associative_scan_log, log_g)" if LSTM
    else "minGRU_pytorch/minGRU.py (minGRU, heinsen_associative_scan_log, log_g)")
HEADS_, KV_HEADS_ = 1, 1  # no heads: a channel-wise recurrence


def model():
    torch.manual_seed(0)
    return minLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, ff_mult=2, expansion=1.5, conv_kernel_size=3,
                 use_lstm=LSTM, enable_conv=True, dropout=0.)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
