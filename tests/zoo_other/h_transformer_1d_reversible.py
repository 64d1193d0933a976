"""lucidrains' H-Transformer-1D as its README builds it (``HTransformer1D(..., causal=True, reversible=True,
shift_tokens=True)``, pip ``h-transformer-1d``), its own classes unchanged: ``h_transformer_1d_causal.py``'s model
with the reversible residual (``ReversibleSequence``: the embedding duplicated into two half streams,
``_ReversibleFunction``, an autograd ``Function`` running every block under ``torch.no_grad`` in the forward and
recomputing each block's input from its output in its own backward, with the RNG state saved by ``Deterministic``;
the two streams summed at the end) and token shift (``PreShiftTokens`` with shifts ``(0, 1)``: a slice of the
features moved one position later by ``F.pad``) before each attention and feed-forward. Same sizes: dim 64, 4 heads
of 16, 2 layers, ff_mult 2, vocabulary 128, ``max_seq_len`` 8, ``block_size`` 2. Built by
``h_transformer_1d_causal.py`` with ``H_TRANSFORMER_REVERSIBLE=1``.
"""
import os

os.environ["H_TRANSFORMER_REVERSIBLE"] = "1"
from h_transformer_1d_causal import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                                     example_kwargs, example_target, loss_fn, model, optimizer)
