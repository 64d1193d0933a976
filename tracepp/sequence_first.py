"""Sequence-first modules met by microbatches cut along another dim: a silent wrong answer found at trace time.

PyTorch's recurrent layers and its transformer modules read ``[seq, batch, features]`` unless built with
``batch_first=True`` (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``,
``nn.Transformer``: the default), and models written for them (PyTorch's own ``word_language_model`` example) lay
their batches out ``[seq, batch]``. tracepp cuts the batch into microbatches along the model file's ``batch_dim``
(0 unless it says 1). Cut along the sequence, each microbatch would be a stretch of every sequence: a pipelined
run would train on other data than eager, and say nothing.

:class:`Watch` hooks every module whose ``batch_first`` is False while ``torch.export`` runs forward on one
microbatch, and finds the one whose input's dim 0 is the microbatch's size where its dim 1 (its batch) is not:
the microbatches reach it as its sequence. The split then stops, naming the module and the fix (``batch_dim = 1``).
"""
from __future__ import annotations

import contextlib

import torch


class SequenceFirstError(ValueError):
    """A sequence-first module reads as its sequence the dim tracepp cuts into microbatches."""


class Watch:
    """Pre-forward hooks on the sequence-first modules of one traced model (:meth:`on`), then :meth:`check`."""

    def __init__(self, batch_dim: int, microbatch: int, batch_size: int):
        self.batch_dim, self.microbatch, self.batch_size = batch_dim, microbatch, batch_size
        self.found = None  # (module's name, its class, its input's shape)

    @contextlib.contextmanager
    def on(self, model: torch.nn.Module):
        handles = []
        for name, module in model.named_modules():
            if getattr(module, "batch_first", None) is False:
                handles.append(module.register_forward_pre_hook(self._hook(name), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str):
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()), None)
            if self.found is None and isinstance(x, torch.Tensor) and x.dim() == 3:
                seq, batch = x.shape[0], x.shape[1]
                if isinstance(seq, int) and isinstance(batch, int) and seq == self.microbatch != batch:
                    self.found = (name, type(module).__name__, list(x.shape))
        return hook

    def check(self) -> None:
        if self.found is None:
            return
        name, kind, shape = self.found
        raise SequenceFirstError(
            f"{kind} '{name}' is sequence-first (batch_first=False): it reads dim 1 of its input {shape} as the "
            f"batch, but its dim 0 holds the microbatch tracepp cut ({self.microbatch} of the {self.batch_size} "
            f"along dim {self.batch_dim} of the batched inputs): each microbatch would be a stretch of every "
            f"sequence, and the pipeline would train on other data than eager. Declare `batch_dim = 1` in the model "
            f"file if its batches are laid out [seq, batch] (the samples on dim 1 of every batched input and of the "
            f"target), or build the module with batch_first=True and lay the batch out [batch, seq]")


def hint(model: torch.nn.Module, batch_dim: int) -> str:
    """What to add to a warning that the model's outputs differ on microbatches, where it holds sequence-first
    modules and its batches are cut along dim 0: the layout may be ``[seq, batch]`` (the sizes left :class:`Watch`
    no way to tell the sequence from the batch)."""
    names = [name for name, module in model.named_modules() if getattr(module, "batch_first", None) is False]
    if batch_dim != 0 or not names:
        return ""
    return (f". The model holds sequence-first modules (batch_first=False: {', '.join(repr(n) for n in names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): if its batches are laid out [seq, batch], declare `batch_dim = 1` "
            f"in the model file, or microbatches cut sequences")


@contextlib.contextmanager
def causal_mask_hint_off():
    """``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` compare a mask they are given with a causal one to pass
    ``is_causal`` on to their layers (a hint for a faster kernel: the mask is applied either way); that compares
    values, which ``torch.export`` cannot trace ("Could not guard on data-dependent expression"). While tracing, the
    hint is what the caller said (``is_causal=True``, else off): the mask is applied as given, the same numbers."""
    from torch.nn.modules import transformer

    original = getattr(transformer, "_detect_is_causal_mask", None)
    if original is None:
        yield
        return

    def as_given(mask, is_causal=None, size=None):
        return is_causal is True

    transformer._detect_is_causal_mask = as_given
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original
