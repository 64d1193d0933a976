"""The reversible form of ``linear_attention_transformer_lm.py``'s model (``reversible=True``: its
``ReversibleSequence``, whose ``_ReversibleFunction`` runs the blocks under ``torch.no_grad`` and recomputes them in its
backward, with ``Deterministic``'s RNG replay); the same sizes. Built by ``linear_attention_transformer_lm.py`` with
``LINEAR_ATTENTION_REVERSIBLE=1``.
"""
import os

os.environ["LINEAR_ATTENTION_REVERSIBLE"] = "1"
from linear_attention_transformer_lm import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                                             example_kwargs, example_target, loss_fn, model, optimizer)
