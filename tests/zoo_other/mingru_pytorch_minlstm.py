"""lucidrains' minLSTM language model (``minGRU_pytorch.minLM`` with ``use_lstm=True``, pip ``minGRU-pytorch``), its
own classes unchanged: ``minLSTM`` (one fused projection of hidden, forget and input gates, chunked in three,
normalised gates in log space with ``softplus``, then the log-space Heinsen scan: ``cumsum`` and ``logcumsumexp``)
in pre-RMSNorm residual blocks with a causal depthwise conv and a GELU MLP; dim 64, 2 layers, vocabulary 128.
The model is built by ``mingru_pytorch_mingru.py`` with ``MINGRU_LSTM=1``.
"""
import os

os.environ["MINGRU_LSTM"] = "1"
from mingru_pytorch_mingru import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                                   example_kwargs, example_target, loss_fn, model, optimizer)
