"""Whether a model computes each sample apart from the others of its batch: the premise of pipelining it.

A pipelined run splits the batch into microbatches and runs each through the stages on its own. A model whose output
for a sample depends on the other samples of its batch (statistics over the batch dim, tokens routed with a capacity
counted over the whole batch, a gather that indexes one sample's rows by another's, or a library's slip of the same
effect: mixture-of-attention's router gathers sample ``i // routes``'s tokens for sample ``i``) then computes another
function than the same model on the whole batch, and trains to other parameters, with nothing failing.

:func:`check` runs the model eagerly on the example batch, whole and microbatch by microbatch, and compares the
outputs: where they differ beyond the rounding of a different batch size, it says so, naming the output and the sample
where they differ most. It runs only where that comparison means something and costs little: the model built with
real weights, small enough to run three more times in seconds (:data:`BUDGET`), drawing no random numbers, writing
no buffer in forward, and computing in float32 or float64; on a copy taken before tracing (:func:`probe`)."""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.utils._pytree as pytree

BUDGET = 10 ** 10  # parameters x example-batch elements, at most (a few seconds of forwards on a CPU): a model traced
#                   with real weights but large, or a large example batch, is not run again
TOLERANCE = 1e-4  # of the whole batch's largest output magnitude (at least 1): float32 rounding of another batch size
#                   stays under 1e-6 of it


def probe(model: torch.nn.Module, num_microbatches: int, batch_size: int,
          elements: int = 0) -> Optional[torch.nn.Module]:
    """A copy of the model to run :func:`check` on, taken before it is traced (export runs forward on fake tensors,
    and a model that caches a tensor in forward, x-transformers' ALiBi bias, keeps the fake one: run again after,
    it computes with it), or None where the check would not run: one microbatch, weights on meta or in another
    dtype than float32/64, more than :data:`BUDGET` parameters times ``elements`` (of the example batch's batched
    inputs), or a model that cannot be copied."""
    if num_microbatches < 2 or batch_size < 2:
        return None
    if sum(p.numel() for p in model.parameters()) * elements > BUDGET:
        return None
    floating = [p for p in list(model.parameters()) + list(model.buffers()) if p.is_floating_point()]
    if any(p.is_meta for p in floating) or any(p.dtype not in (torch.float32, torch.float64) for p in floating):
        return None
    try:
        return copy.deepcopy(model)
    except Exception:  # noqa: BLE001 (a model holding what does not copy: not checked)
        return None


def check(model: torch.nn.Module, program, leaves: list, spec, batched: list, batch_size: int,
          num_microbatches: int, dim: int = 0) -> Optional[str]:
    """A warning where the model's outputs on the whole example batch and on its microbatches differ, else None.
    ``model``: :func:`probe`'s copy; ``leaves``/``spec``: the flattened (args, kwargs) of the example batch;
    ``batched``: which leaves have the batch dim (``dim``); ``program``: the traced program (a program that writes buffers is
    not run again). Whatever fails on the way is no finding."""
    if model is None or program.graph_signature.buffers_to_mutate:
        return None
    try:
        return _compared(model, leaves, spec, batched, batch_size, num_microbatches, dim)
    except Exception:  # noqa: BLE001 (a forward that runs only at the traced size, an output of another kind)
        return None


def _compared(model, leaves: list, spec, batched: list, batch_size: int, num_microbatches: int,
              dim: int) -> Optional[str]:
    size = -(-batch_size // num_microbatches)
    pieces = [[leaf.narrow(dim, start, min(size, batch_size - start)) if flag else leaf
               for leaf, flag in zip(leaves, batched)] for start in range(0, batch_size, size)]
    with torch.no_grad(), torch.random.fork_rng():
        whole = _outputs(model, leaves, spec, batch_size, dim)
        again = _outputs(model, leaves, spec, batch_size, dim)
        parts = [_outputs(model, piece, spec, min(size, batch_size - k * size), dim) for k, piece in enumerate(pieces)]
    if any(_differs(whole[index], again.get(index)) for index in whole):
        return None  # the whole batch twice gives two answers: random draws the trace did not see (reformer's LSH
        #              inside its reversible autograd.Function), not samples that mix
    worst = None
    for index, value in whole.items():
        if not all(index in part for part in parts):
            continue
        gap, diff = _gap(value, torch.cat([part[index] for part in parts], dim=dim))
        if gap > TOLERANCE and (worst is None or gap > worst[0]):
            sample = int(diff.movedim(dim, 0).reshape(diff.shape[dim], -1).amax(dim=1).argmax())
            worst = (gap, index, sample, float(diff.max()))
    if worst is None:
        return None
    _, index, sample, diff = worst
    return (f"the model's output for a sample depends on the other samples of its batch: run on the example batch "
            f"of {batch_size} whole and as {len(parts)} microbatches of {size}, its output leaf {index} differs by "
            f"{diff:.2e} (sample {sample}). A pipelined run computes each microbatch apart, so it trains as eager "
            f"training on microbatches of {size} would, not as on the whole batch: statistics over the batch dim, "
            f"a capacity counted over the batch's tokens, or a gather across samples. Keep each sample's computation "
            f"to itself, or train eager on microbatches of this size to compare")


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(the largest difference of ``b`` from ``a`` over ``a``'s magnitude, at least 1; the differences)."""
    diff = (a.double() - b.double()).abs()
    return float(diff.max()) / max(1.0, float(a.abs().max())), diff


def _differs(a: torch.Tensor, b) -> bool:
    """``b`` is missing or differs from ``a`` beyond :data:`TOLERANCE` of ``a``'s magnitude."""
    return b is None or a.shape != b.shape or _gap(a, b)[0] > TOLERANCE


def _outputs(model: torch.nn.Module, leaves: list, spec, batch: int, dim: int) -> dict:
    """{output leaf index: tensor} of the model's floating outputs that have the batch dim (``dim``)."""
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    out = model(*args, **kwargs)
    flat = pytree.tree_leaves(out)
    return {k: v for k, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.is_floating_point()
            and v.dim() > dim and v.shape[dim] == batch}
