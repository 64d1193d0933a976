"""Lowering: turn per-rank compute lists into full plans with explicit send/recv actions.

For every activation edge (i, j) whose stages sit on different ranks, the producer rank gets
``SEND_F`` right after ``F(i, m)`` and the consumer rank gets ``RECV_F`` somewhere before ``F(j, m)``;
gradient edges get ``SEND_B`` right after the consumer's backward (B or I) and ``RECV_B`` before the
producer's backward. Edges between stages on the same rank get no comm action: values stay in memory.

Where a receive goes: the lowering replays the compute lists with unit costs (F=1, B=2, I=1, W=1) and
posts each receive around the time its data is due: either after the last compute on the consumer rank
that *starts* before the matching send ("timed") or after the last one that *ends* by then ("early"),
never later than just before the consumer; it keeps whichever passes :func:`validate` with the shorter
simulated makespan. Posting receives when their data is due keeps each rank's FIFO comm stream from
stalling (posting every receive just before its consumer deadlocks many interleaved and V schedules),
and the per-rank-pair order of receives equals the order of the sends (which NCCL requires).
"""
from __future__ import annotations

from .actions import Action, Topology
from .simulate import (ScheduleError, compute_deps, consumers, cost_of, grad_producers, produced_key,
                       recv_for, simulate, validate)


def dataflow_times(compute: dict, stage_to_rank: list, topology: Topology, costs=None) -> dict:
    """Start/end of every compute action when data moves instantly: ``{(rank, pos): (start, end)}``.

    Raises :class:`ScheduleError` when the compute orders alone deadlock (or an input never appears).
    """
    ranks = sorted(compute)
    pc = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    ready: dict[tuple, float] = {}
    times: dict[tuple, tuple] = {}
    progress = True
    while progress:
        progress = False
        for r in ranks:
            acts = compute[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                deps = compute_deps(a, topology)
                if any(d not in ready for d in deps):
                    break
                start = max([clock[r]] + [ready[d] for d in deps])
                end = start + cost_of(a, costs)
                times[(r, pc[r])] = (start, end)
                ready[produced_key(a)] = end
                clock[r] = end
                pc[r] += 1
                progress = True
    stuck = [r for r in ranks if pc[r] < len(compute[r])]
    if stuck:
        parts = []
        for r in stuck:
            a = compute[r][pc[r]]
            missing = [d for d in compute_deps(a, topology) if d not in ready]
            need = ", ".join(f"{s}{'F' if w == 'F' else 'B/I'}{m}" for s, w, m in missing)
            parts.append(f"rank {r} waits at action {pc[r]} '{a}' for {need}")
        raise ScheduleError("compute order deadlocks: " + "; ".join(parts))
    return times


def _infer_microbatches(actions: dict) -> int:
    return max([a.mb + 1 for acts in actions.values() for a in acts] + [0])


def lower(compute: dict, stage_to_rank: list, topology: Topology, training: bool = True,
          recv_policy: str = "auto") -> dict:
    """Insert comm actions into per-rank compute lists; already-lowered input is checked and returned.

    ``recv_policy``: ``"timed"`` posts a receive after the last compute on its rank that starts before the
    matching send is due (unit-cost replay); ``"early"`` after the last compute that ends by then;
    ``"late"`` just before the consumer (often deadlocks under FIFO comm streams); ``"auto"`` (default)
    tries "timed" and "early" and keeps the valid one with the shorter simulated makespan.
    Peer-less comm actions in lowered input are resolved from the topology first.

    Returns ``{rank: [Action, ...]}`` for every rank that holds a stage.
    """
    stage_to_rank = list(stage_to_rank)
    compute = {r: list(v) for r, v in compute.items()}
    for r in set(stage_to_rank):
        compute.setdefault(r, [])
    if any(a.is_comm for acts in compute.values() for a in acts):
        if any(a.is_comm and a.peer is None for acts in compute.values() for a in acts):
            from .csvio import resolve_peers
            compute = resolve_peers(compute, topology)
        validate(compute, stage_to_rank, topology, _infer_microbatches(compute), training)
        return compute
    for r, acts in compute.items():
        for pos, a in enumerate(acts):
            if not 0 <= a.stage < len(stage_to_rank) or stage_to_rank[a.stage] != r:
                home = stage_to_rank[a.stage] if 0 <= a.stage < len(stage_to_rank) else "no rank"
                raise ScheduleError(f"rank {r}, action {pos} '{a}': stage {a.stage} lives on {home}")
            if not training and a.kind != "F":
                raise ScheduleError(f"rank {r}, action {pos} '{a}': a forward-only plan has only F actions")
    times = dataflow_times(compute, stage_to_rank, topology)
    if recv_policy != "auto":
        return _insert_comms(compute, stage_to_rank, topology, training, times, recv_policy)
    best, best_time, first_error = None, None, None
    num_microbatches = _infer_microbatches(compute)
    for policy in ("timed", "early"):
        candidate = _insert_comms(compute, stage_to_rank, topology, training, times, policy)
        try:
            makespan = simulate(candidate, stage_to_rank, topology, num_microbatches, training=training).makespan
        except ScheduleError as err:
            first_error = first_error or err
            continue
        if best_time is None or makespan < best_time:
            best, best_time = candidate, makespan
    if best is None:
        raise first_error
    return best


def _insert_comms(compute, stage_to_rank, topology, training, times, recv_policy):
    """Sends right after their producer; receives placed by ``recv_policy`` (see :func:`lower`)."""

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
        recvs_before: dict[int, list] = {}
        for pos, a in enumerate(acts):
            for dep in compute_deps(a, topology):
                if stage_to_rank[dep[0]] == r:
                    continue
                recv = recv_for(dep, a.stage)
                t_send, src_rank, src_pos, _ = send_info[recv]
                if recv_policy == "timed":
                    slot = min(sum(1 for s in starts if s < t_send), pos)
                elif recv_policy == "early":
                    ends = [times[(r, q)][1] for q in range(len(acts))]
                    slot = min(sum(1 for e in ends if e <= t_send), pos)
                else:  # "late": just before the consumer
                    slot = pos
                recvs_before.setdefault(slot, []).append(((t_send, src_rank, src_pos, a.stage), recv))
        seq: list = []
        for pos, a in enumerate(acts):
            seq.extend(rv for _, rv in sorted(recvs_before.get(pos, []), key=lambda x: x[0]))
            seq.append(a)
            seq.extend(sends_after[(r, pos)])
        out[r] = seq
    return out
