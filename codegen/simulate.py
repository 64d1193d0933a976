"""Time and check a plan with the one replay engine: bubbles, peak in-flight microbatches, validation.

The engine, its execution model, the validator and the unit costs live in ``tracepp.runtime.replay`` (standard
library only, so a rank whose script was edited can validate the gathered plan at start-up with the same code);
this module is the planner's view of it. :func:`validate` raises :class:`ScheduleError` for a plan that breaks a
rule or would deadlock; :func:`simulate` validates and replays with per-action costs (comms cost 0 unless a
``runtime.replay.CommModel`` is given: the calibrated simulator of ``tracepp.costs.model``) into a
:class:`SimResult` for ``tracepp plan``, ``tracepp inspect``, the tuner and the benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tracepp.runtime.actions import Topology
from tracepp.runtime.replay import (INPUT_GRAD, UNIT_COSTS, CommModel, ScheduleError, check_plan,  # noqa: F401
                                    compute_deps, consumers, cost_of, grad_consumers, grad_producers, produced_key,
                                    producers, recv_for, replay, validate)


@dataclass
class SimResult:
    """Timeline of one plan under the execution model (comms cost 0 unless a CommModel was given).

    ``timeline[rank]`` lists ``(action, start, end)`` for compute actions in execution order;
    ``comm[rank]`` lists ``(actions, posted, completed)`` per comm batch. ``bubble[rank]`` is
    idle/makespan; ``bubble_overall`` is total idle over ``num_ranks * makespan``. ``peak_inflight[rank]``
    counts (stage, microbatch) pairs whose F has run and whose backward (B or I) has not. ``costs``: the
    costs the replay used (the unit costs, overridden by the caller's). ``ends[rank]``: when the rank's step is
    over (its last compute or, the runtime waiting on every send at the end of a step, its last comm op).
    """

    stage_to_rank: list
    num_microbatches: int
    timeline: dict
    comm: dict
    makespan: float
    busy: dict
    bubble: dict
    bubble_overall: float
    peak_inflight: dict
    costs: dict = field(default_factory=dict)
    ends: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.timeline)


def simulate(lowered: dict, stage_to_rank: list, topology: Topology, num_microbatches: int,
             costs: Optional[dict] = None, training: Optional[bool] = None,
             comm: Optional[CommModel] = None, check: bool = True) -> SimResult:
    """Validate, then time ``lowered`` with compute ``costs`` (default :data:`UNIT_COSTS`) and ``comm`` (default:
    comms free, no overheads). ``check=False``: a plan the planner made and validated already is only timed."""
    if training is None:
        training = any(a.kind in ("B", "I", "W") for actions in lowered.values() for a in actions)
    if not check:
        result = replay({r: list(a) for r, a in lowered.items()}, list(stage_to_rank), topology, costs, comm)
    elif comm is not None and not comm.serial:  # FIFO deadlocks are seen by the serial model only
        validate(lowered, stage_to_rank, topology, num_microbatches, training)
        result = replay({r: list(a) for r, a in lowered.items()}, list(stage_to_rank), topology, costs, comm)
    else:
        result = validate(lowered, stage_to_rank, topology, num_microbatches, training, costs, comm)
    timeline = {r: [(a, start, end) for _, a, start, end in entries] for r, entries in sorted(result.timeline.items())}
    comm_batches = {r: [(list(b.ops), b.posted, b.done) for b in batches]
                    for r, batches in sorted(result.batches.items())}
    makespan = result.makespan
    busy = {r: sum(end - start for _, start, end in entries) for r, entries in timeline.items()}
    bubble = {r: (1.0 - busy[r] / makespan) if makespan > 0 else 0.0 for r in timeline}
    total = makespan * len(timeline)
    bubble_overall = (1.0 - sum(busy.values()) / total) if total > 0 else 0.0
    peak = {}
    for r, entries in timeline.items():
        live: set = set()
        best = 0
        for a, _, _ in entries:
            if a.kind == "F":
                live.add((a.stage, a.mb))
            elif a.kind in ("B", "I"):
                live.discard((a.stage, a.mb))
            best = max(best, len(live))
        peak[r] = best
    return SimResult(list(stage_to_rank), num_microbatches, timeline, comm_batches, makespan, busy, bubble,
                     bubble_overall, peak, result.costs, dict(result.ends))
