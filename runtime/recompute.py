"""Activation checkpointing of pipeline stages: ``--activation-checkpointing MODE``.

A checkpointed stage runs its forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant), block by block
where its code calls repeated blocks (each transformer layer on its own, as torchtitan does; whole otherwise), and
the forward is recomputed during that microbatch's backward. The recomputation is the same computation, so
gradients are bit-identical in fp32. MODE is one of:

* ``none``: keep every activation autograd saves (default).
* ``full``: checkpoint every stage of this rank: only a stage's inputs are kept per microbatch in flight.
* ``selective``: torchtitan's op-level policy on every stage of this rank (``selective_ac_option = "op"``): the
  outputs of the matmuls, of attention and of the collectives are kept, everything between them (norms,
  activations, rotary, elementwise ops) is recomputed in backward. Most of the memory of ``full`` is saved for a
  small part of its recomputation, and no collective runs twice.
* ``every-K``: full checkpointing of every K-th block of each stage (the 1st, (K+1)-th, ...; torchtitan's
  ``selective_ac_option = "K"``), the other blocks keeping everything.
* ``in-flight``: ``full`` for the stages that hold more than one microbatch's activations at once in this rank's
  action list (e.g. every stage of a 1F1B pipeline but the last, which runs each backward right after its forward
  and would pay the recomputation for no memory).
* one mode per stage of the pipeline, comma-separated (``full,selective,none,none``): what ``tracepp plan --tune``
  chooses under ``--memory-limit``, and what ``tracepp split --activation-checkpointing`` records for run.py.

``Pipeline(folder)`` applies the split's mode (``run_options``) itself (:func:`apply`), as run.py's does: a loop of
your own gets the checkpointing the plan counted without calling anything here.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import re

import torch

from .actions import Action

STAGE_MODES = ("none", "full", "selective")
MODES = STAGE_MODES + ("in-flight",)
_EVERY = re.compile(r"^every-([1-9][0-9]*)$")  # full checkpointing of every K-th block of a stage


def is_stage_mode(mode: str) -> bool:
    """none, full, selective, or every-K (full checkpointing of the stage's 1st, (K+1)-th, ... block)."""
    return mode in STAGE_MODES or _EVERY.match(mode) is not None


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
    """Refuse a mode that is not one of :data:`MODES`, every-K, or a per-stage list of those of one stage."""
    if mode in MODES or is_stage_mode(mode):
        return
    parts = [part.strip() for part in mode.split(",")]
    if len(parts) > 1 and all(is_stage_mode(part) for part in parts):
        if num_stages is not None and len(parts) != num_stages:
            raise ValueError(f"--activation-checkpointing {mode!r} lists {len(parts)} stage modes; the pipeline has "
                             f"{num_stages} stages: give one of {', '.join(STAGE_MODES)} per stage, or one of "
                             f"{', '.join(MODES)} for all")
        return
    raise ValueError(f"--activation-checkpointing {mode!r} is not one of {', '.join(MODES)}, every-K (every K-th "
                     f"block), or one of {', '.join(STAGE_MODES)}, every-K per stage, comma-separated")


def stage_modes(mode: str, num_stages: int, actions_of=None) -> list:
    """The mode of every stage (none, full or selective) under ``mode``; ``actions_of(stage)`` gives the action
    list of the rank that runs a stage (for ``in-flight``)."""
    check_mode(mode, num_stages)
    if is_stage_mode(mode):
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
    elif is_stage_mode(mode):
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
        stage = pipe.stages[stage_index]
        stage.recompute = stage_mode
        stage.recompute_blocks = wrap_blocks(stage.function, stage_index)
    return chosen


# -- checkpointing block by block --------------------------------------------------------------------------------
#
# A stage whose code calls repeated blocks (the rank script's block functions, ``STAGE_BLOCKS``) is checkpointed
# block by block, as torchtitan does a transformer layer at a time: each block keeps its inputs, and backward
# recomputes one block at a time (whole-stage checkpointing would recompute every block of the stage at once).
# The rank script's block functions are wrapped once; the stage's forward says how (:func:`blocks_checkpointed`).

_BLOCK_MODE: contextvars.ContextVar = contextvars.ContextVar("tracepp_block_checkpointing", default=None)


def wrap_blocks(function, stage_index: int) -> bool:
    """Wrap the block functions ``function``'s stage calls (its module's ``STAGE_BLOCKS``) so that they checkpoint
    as the running stage says; False when the stage calls none (it is then checkpointed as a whole)."""
    namespace = getattr(function, "__globals__", None)
    calls = (namespace or {}).get("STAGE_BLOCKS", {}).get(stage_index)
    if not calls:
        return False
    for name in calls:
        block = namespace.get(name)
        if block is not None and not getattr(block, "tracepp_checkpointed", False):
            namespace[name] = _checkpointed(block)
    return True


def _checkpointed(block):
    @functools.wraps(block)
    def run(*args):
        state = _BLOCK_MODE.get()
        if state is None or not torch.is_grad_enabled():
            return block(*args)
        mode, count = state
        index = count[0]
        count[0] += 1
        every = _EVERY.match(mode)
        if mode == "full" or (every is not None and index % int(every.group(1)) == 0):
            return checkpoint(block, *args, use_reentrant=False)
        if mode == "selective":
            return checkpoint(block, *args, use_reentrant=False, context_fn=selective_context)
        return block(*args)

    from torch.utils.checkpoint import checkpoint

    run.tracepp_checkpointed = True
    return run


@contextlib.contextmanager
def blocks_checkpointed(mode: str):
    """Around a stage's forward: its block calls checkpoint under ``mode`` (counted from its first block)."""
    token = _BLOCK_MODE.set((mode, [0]))
    try:
        yield
    finally:
        _BLOCK_MODE.reset(token)


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
