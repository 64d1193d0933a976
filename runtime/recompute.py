"""Activation checkpointing of pipeline stages: ``--activation-checkpointing none|full|selective``.

A checkpointed stage runs its forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant): only the
stage's inputs are kept per in-flight microbatch, and the forward is recomputed during that microbatch's
backward. The recomputation is the same computation, so gradients are bit-identical in fp32.

* ``none``: keep every activation (default).
* ``full``: checkpoint every stage of this rank.
* ``selective``: checkpoint only the stages that hold more than one microbatch's activations at once in this
  rank's action list (e.g. every stage of a 1F1B pipeline but the last, which runs each backward right after
  its forward and would pay the recomputation for no memory).
"""
from __future__ import annotations

from .executor import parse_action

MODES = ("none", "full", "selective")


def max_in_flight(actions: list, stage_index: int) -> int:
    """The largest number of microbatches whose forward has run on ``stage_index`` and whose backward has not
    started, over this rank's action list."""
    live, peak = set(), 0
    for text in actions:
        stage, kind, microbatch, _peer = parse_action(text)
        if stage != stage_index:
            continue
        if kind == "F":
            live.add(microbatch)
            peak = max(peak, len(live))
        elif kind in ("B", "I"):
            live.discard(microbatch)
    return peak


def stages_to_checkpoint(mode: str, stage_indices, actions: list) -> list:
    """The stage indices of this rank to checkpoint under ``mode``."""
    if mode not in MODES:
        raise ValueError(f"--activation-checkpointing {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return []
    if mode == "full":
        return sorted(stage_indices)
    return sorted(s for s in stage_indices if max_in_flight(actions, s) > 1)


def apply(pipe, mode: str) -> list:
    """Turn on checkpointing for this rank's stages of ``pipe`` chosen by ``mode``; returns their indices."""
    chosen = stages_to_checkpoint(mode, pipe.stages, pipe.executor.actions)
    for stage_index in chosen:
        pipe.stages[stage_index].recompute = True
    return chosen
