"""Lowering: turn per-rank compute lists into full plans with explicit send/recv actions.

For every activation edge (i, j) whose stages sit on different ranks, the producer rank gets
``SEND_F`` right after ``F(i, m)`` and the consumer rank gets ``RECV_F`` somewhere before ``F(j, m)``;
gradient edges get ``SEND_B`` right after the consumer's backward (B or I) and ``RECV_B`` before the
producer's backward. Edges between stages on the same rank get no comm action: values stay in memory.

Where a receive goes: the lowering replays the compute lists with the engine (``runtime.replay``: unit costs,
data moving instantly) and posts each receive around the time its data is due: either after the last compute
on the consumer rank that *starts* before the matching send ("timed") or after the last one that *ends* by
then ("early"), never later than just before the consumer. It replays both lowered candidates once each and
keeps the one that does not deadlock with the shorter makespan ("timed" on a tie); the plan records which.
Posting receives when their data is due keeps each rank's FIFO comm stream from stalling (posting every
receive just before its consumer deadlocks many interleaved and V schedules), and the per-rank-pair order of
receives equals the order of the sends (which NCCL requires).
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

from tracepp.runtime.actions import Action, Topology
from tracepp.runtime.replay import (ReplayResult, ScheduleError, compute_deps, consumers, grad_producers, recv_for,
                                    replay)

RECV_PLACEMENTS = ("timed", "early")


class Lowered(NamedTuple):
    """A lowered plan with how it was made and its replay: ``recv_placement`` is "timed" or "early" (see the
    module doc), or "as given" for input that was lowered already."""
    actions: dict
    recv_placement: str
    replay: ReplayResult


def lower(compute: dict, stage_to_rank: list, topology: Topology, training: bool = True) -> dict:
    """Insert comm actions into per-rank compute lists (see :func:`lower_and_replay`); ``{rank: [Action]}``."""
    return lower_and_replay(compute, stage_to_rank, topology, training).actions


def lower_and_replay(compute: dict, stage_to_rank: list, topology: Topology, training: bool = True) -> Lowered:
    """Lower compute-only lists, replaying each receive placement once; lowered input is returned as given
    (peer-less torch-style comm actions resolved from the topology first) with its replay.

    The lists are assumed to pass ``check_plan`` (``plan.build_plan`` checks them first); a placement that
    deadlocks is dropped, and if both do the first deadlock is raised. Every rank that holds a stage gets a list.
    """
    stage_to_rank = list(stage_to_rank)
    compute = {r: list(v) for r, v in compute.items()}
    for r in set(stage_to_rank):
        compute.setdefault(r, [])
    if any(a.is_comm for acts in compute.values() for a in acts):
        if any(a.is_comm and a.peer is None for acts in compute.values() for a in acts):
            from .csvio import resolve_peers
            compute = resolve_peers(compute, topology)
        return Lowered(compute, "as given", replay(compute, stage_to_rank, topology))
    dataflow = replay(compute, stage_to_rank, topology)  # compute-only: data moves instantly
    times = {(r, pos): (start, end) for r, entries in dataflow.timeline.items() for pos, _a, start, end in entries}
    best, first_error = None, None
    for placement in RECV_PLACEMENTS:
        candidate = _insert_comms(compute, stage_to_rank, topology, training, times, placement)
        try:
            result = replay(candidate, stage_to_rank, topology)
        except ScheduleError as err:
            first_error = first_error or err
            continue
        if best is None or result.makespan < best.replay.makespan:
            best = Lowered(candidate, placement, result)
    if best is None:
        raise first_error
    return best


def _insert_comms(compute, stage_to_rank, topology, training, times, recv_placement):
    """Sends right after their producer; receives placed by ``recv_placement`` (see the module doc)."""

    # where each send happens: (rank, pos of producing compute) and its time
    send_info: dict[Action, tuple] = {}  # recv action -> (send time, producer rank, producer pos)
    sends_after: dict[tuple, list] = {}
    for r, acts in compute.items():
        for pos, a in enumerate(acts):
            outs = []
            if a.kind == "F":
                outs = [Action(a.stage, "SEND_F", a.mb, j) for j in consumers(topology, a.stage)
                        if stage_to_rank[j] != r]
            elif a.kind in ("B", "I") and training:
                outs = [Action(a.stage, "SEND_B", a.mb, i) for i in grad_producers(topology, a.stage)
                        if stage_to_rank[i] != r]
            sends_after[(r, pos)] = outs
            for s in outs:
                recv = Action(s.peer, "RECV_F" if s.kind == "SEND_F" else "RECV_B", s.mb, s.stage)
                send_info[recv] = (times[(r, pos)][1], r, pos, s.peer)

    out: dict[int, list] = {}
    for r, acts in compute.items():
        starts = [times[(r, pos)][0] for pos in range(len(acts))]
        ends = [times[(r, pos)][1] for pos in range(len(acts))]
        recvs_before: dict[int, list] = {}
        for pos, a in enumerate(acts):
            for dep in compute_deps(a, topology):
                if stage_to_rank[dep[0]] == r:
                    continue
                recv = recv_for(dep, a.stage)
                t_send, src_rank, src_pos, _ = send_info[recv]
                # a rank's computes run one after another: its start and end times are sorted
                if recv_placement == "timed":
                    slot = min(bisect.bisect_left(starts, t_send), pos)
                else:  # "early"
                    slot = min(bisect.bisect_right(ends, t_send), pos)
                recvs_before.setdefault(slot, []).append(((t_send, src_rank, src_pos, a.stage), recv))
        seq: list = []
        for pos, a in enumerate(acts):
            seq.extend(rv for _, rv in sorted(recvs_before.get(pos, []), key=lambda x: x[0]))
            seq.append(a)
            seq.extend(sends_after[(r, pos)])
        out[r] = seq
    return out
