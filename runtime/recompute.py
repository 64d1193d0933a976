"""Activation checkpointing of pipeline stages: ``--activation-checkpointing MODE``.

A checkpointed stage runs its forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant), and the
forward is recomputed during that microbatch's backward. The recomputation is the same computation, so
gradients are bit-identical in fp32. MODE is one of:

* ``none``: keep every activation autograd saves (default).
* ``full``: checkpoint every stage of this rank: only a stage's inputs are kept per microbatch in flight.
* ``selective``: torchtitan's op-level policy on every stage of this rank (``selective_ac_option = "op"``): the
  outputs of the matmuls, of attention and of the collectives are kept, everything between them (norms,
  activations, rotary, elementwise ops) is recomputed in backward. Most of the memory of ``full`` is saved for a
  small part of its recomputation, and no collective runs twice.
* ``in-flight``: ``full`` for the stages that hold more than one microbatch's activations at once in this rank's
  action list (e.g. every stage of a 1F1B pipeline but the last, which runs each backward right after its forward
  and would pay the recomputation for no memory).
* one mode per stage of the pipeline, comma-separated (``full,selective,none,none``): what ``tracepp plan --tune``
  chooses under ``--memory-limit``, and what ``tracepp split --activation-checkpointing`` records for run.py.
"""
from __future__ import annotations

import functools

import torch

from .actions import Action

STAGE_MODES = ("none", "full", "selective")
MODES = STAGE_MODES + ("in-flight",)


def parse_action(text: str):
    action = Action.parse(text)
    return action.stage, action.kind, action.mb, action.peer


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


def check_mode(mode: str, num_stages=None) -> None:
    """Refuse a mode that is not one of :data:`MODES` or a per-stage list of :data:`STAGE_MODES`."""
    if mode in MODES:
        return
    parts = [part.strip() for part in mode.split(",")]
    if len(parts) > 1 and all(part in STAGE_MODES for part in parts):
        if num_stages is not None and len(parts) != num_stages:
            raise ValueError(f"--activation-checkpointing {mode!r} lists {len(parts)} stage modes; the pipeline has "
                             f"{num_stages} stages: give one of {', '.join(STAGE_MODES)} per stage, or one of "
                             f"{', '.join(MODES)} for all")
        return
    raise ValueError(f"--activation-checkpointing {mode!r} is not one of {', '.join(MODES)} (or one of "
                     f"{', '.join(STAGE_MODES)} per stage, comma-separated)")


def stage_modes(mode: str, num_stages: int, actions_of=None) -> list:
    """The mode of every stage (none, full or selective) under ``mode``; ``actions_of(stage)`` gives the action
    list of the rank that runs a stage (for ``in-flight``)."""
    check_mode(mode, num_stages)
    if mode in STAGE_MODES:
        return [mode] * num_stages
    if mode == "in-flight":
        if actions_of is None:
            raise ValueError("--activation-checkpointing in-flight needs the plan's action lists")
        return ["full" if max_in_flight(actions_of(s), s) > 1 else "none" for s in range(num_stages)]
    return [part.strip() for part in mode.split(",")]


def stages_to_checkpoint(mode: str, stage_indices, actions: list, num_stages=None) -> dict:
    """{stage index: "full" | "selective"} for this rank's stages under ``mode``."""
    check_mode(mode)
    stage_indices = sorted(stage_indices)
    if mode == "in-flight":
        chosen = {s: "full" for s in stage_indices if max_in_flight(actions, s) > 1}
    elif mode in STAGE_MODES:
        chosen = {s: mode for s in stage_indices}
    else:
        modes = [part.strip() for part in mode.split(",")]
        if num_stages is not None:
            check_mode(mode, num_stages)
        chosen = {s: modes[s] for s in stage_indices}
    return {s: m for s, m in chosen.items() if m != "none"}


def apply(pipe, mode: str) -> dict:
    """Turn on checkpointing for this rank's stages of ``pipe`` chosen by ``mode``; returns {stage: mode}."""
    chosen = stages_to_checkpoint(mode, pipe.stages, pipe.executor.actions, len(pipe.manifest["stages"]))
    for stage_index, stage_mode in chosen.items():
        pipe.stages[stage_index].recompute = stage_mode
    return chosen


# -- the op-level policy -------------------------------------------------------------------------------------

def _saved_ops() -> set:
    """What the selective policy keeps: the outputs of matmuls, attention (every SDPA kernel, flex attention's
    op), grouped expert matmuls, and collectives (tracepp's own and torch's functional ones), whose recomputation
    would cost a matmul or a message."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
             "_flash_attention_forward", "_efficient_attention_forward", "convolution"]
    found = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    for namespace, op_names in (("tracepp", ("tp_all_reduce", "tp_all_gather", "sp_all_gather", "sp_reduce_scatter",
                                             "ep_dispatch", "ep_combine")),
                                ("_c10d_functional", ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                                      "all_to_all_single")),
                                ("transformers", ("grouped_mm_fallback",))):
        packet = getattr(torch.ops, namespace, None)
        for name in op_names:
            op = getattr(packet, name, None) if packet is not None else None
            if op is not None and hasattr(op, "default"):
                found.add(op.default)
    return found


@functools.lru_cache(maxsize=1)
def _saved_op_set() -> frozenset:
    return frozenset(_saved_ops())


def _policy(_ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_op_set() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for ``selective``: the policy above."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)
