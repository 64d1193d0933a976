"""A Mamba language model as mambapy writes it (``lib_style``: ``MambaLM``, its selective scan through ``PScan``, a
``torch.autograd.Function`` that scans in place on views and has a backward of its own); 2 layers, hidden 64, d_state
8, 16 tokens. ``MAMBA_PSCAN=0`` takes mambapy's ``pscan=False`` path (the sequential loop) instead.

Eager training calls ``PScan.backward``. torch.export keeps the forward only, whose in-place updates autograd cannot
differentiate: the split is refused, naming the function, its in-place op and line, and the fix.
"""
import os

import torch
from lib_style import MambaLM, loss_fn, sgd, token_batch

USE_PSCAN = os.environ.get("MAMBA_PSCAN", "1") == "1"


def model():
    torch.manual_seed(0)
    return MambaLM(2, use_pscan=USE_PSCAN)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
