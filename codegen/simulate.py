"""Check and time a lowered pipeline plan under the runtime's strict execution model.

Execution model (what the tracepp runtime does, and what NCCL allows):

* Each rank walks its action list in order.
* A maximal run of consecutive comm actions is one *batch*, posted together (like
  ``torch.distributed.batch_isend_irecv``). Posting never blocks.
* A rank's posted batches complete in FIFO order (one serial comm stream per rank). A batch reaches the
  *head* of its rank's queue when every earlier batch of that rank has completed.
* Point-to-point ops match per ordered rank pair in issue order (no tags): the n-th send from rank A to
  rank B pairs with the n-th receive on B from A. An op is matched once both its batch and its
  counterpart's batch have reached the head of their queues; a batch completes when all its ops are
  matched. This is iterated to a fixpoint over all ranks.
* A compute action blocks until the batches holding the receives it needs have completed.

:func:`validate` raises :class:`ScheduleError` for any plan that is inconsistent or would deadlock under
this model; :func:`simulate` replays the same model with per-action costs (comms cost 0) to produce a
timeline. A plan that passes this model also works under gloo, whose p2p ops are less constrained.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .actions import Action, Topology

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
# The dependency key "this stage's input gradient for a microbatch is done": made by a full backward B or by
# an input-grad backward I, needed by the W of the same stage and by the backward of the stage before.
INPUT_GRAD = "input-grad"


class ScheduleError(ValueError):
    """A pipeline plan is inconsistent or would deadlock; the message names rank, position and action."""


# ----------------------------------------------------------------------------------------------------
# dependency helpers shared by the generators, the lowering and the checks

def producers(topology: Topology, stage: int) -> list[int]:
    """Stages whose activations ``stage`` consumes (forward edges into it), sorted."""
    return sorted({i for i, j in topology.fwd_edges if j == stage})


def consumers(topology: Topology, stage: int) -> list[int]:
    """Stages that consume ``stage``'s activations (forward edges out of it), sorted."""
    return sorted({j for i, j in topology.fwd_edges if i == stage})


def grad_consumers(topology: Topology, stage: int) -> list[int]:
    """Stages that send a gradient back to ``stage`` (grad edges out of it), sorted."""
    return sorted({j for i, j in topology.grad_edges if i == stage})


def grad_producers(topology: Topology, stage: int) -> list[int]:
    """Stages to which ``stage`` sends a gradient (grad edges into it), sorted."""
    return sorted({i for i, j in topology.grad_edges if j == stage})


def compute_deps(action: Action, topology: Topology) -> list[tuple]:
    """Keys a compute action needs: ``(stage, 'F', mb)`` forward done, ``(stage, INPUT_GRAD, mb)`` input grad done.

    ``INPUT_GRAD`` is produced by either a full backward ``B`` or an input-grad backward ``I``.
    """
    s, kind, m = action.stage, action.kind, action.mb
    if kind == "F":
        return [(i, "F", m) for i in producers(topology, s)]
    if kind in ("B", "I"):
        return [(s, "F", m)] + [(j, INPUT_GRAD, m) for j in grad_consumers(topology, s)]
    if kind == "W":
        return [(s, INPUT_GRAD, m)]
    raise ValueError(f"not a compute action: {action}")


def produced_key(action: Action) -> tuple:
    """The dependency key a compute action produces (W produces nothing others wait on)."""
    return (action.stage, "F" if action.kind == "F" else INPUT_GRAD if action.kind in ("B", "I") else "W", action.mb)


def recv_for(dep_key: tuple, consumer_stage: int) -> Action:
    """The receive that carries ``dep_key`` from another rank into ``consumer_stage``."""
    stage, what, mb = dep_key
    if what == "F":
        return Action(consumer_stage, "RECV_F", mb, peer=stage)
    return Action(consumer_stage, "RECV_B", mb, peer=stage)


def cost_of(action: Action, costs) -> float:
    """Cost of a compute action: ``costs`` may map kind -> float or (stage, kind) -> float."""
    if costs:
        if (action.stage, action.kind) in costs:
            return float(costs[(action.stage, action.kind)])
        if action.kind in costs:
            return float(costs[action.kind])
        if action.kind == "B":  # a full backward costs what its two halves do
            i = costs.get((action.stage, "I"), costs.get("I"))
            w = costs.get((action.stage, "W"), costs.get("W"))
            if i is not None and w is not None:
                return float(i) + float(w)
    return DEFAULT_COSTS[action.kind]


# ----------------------------------------------------------------------------------------------------
# static checks

def _where(rank: int, pos: int, action: Action) -> str:
    return f"rank {rank}, action {pos} '{action}'"


def _static_checks(lowered, stage_to_rank, topology, num_microbatches, training):
    num_stages = len(stage_to_rank)
    if topology.num_stages != num_stages:
        raise ScheduleError(
            f"stage_to_rank has {num_stages} stages but the topology has {topology.num_stages}")
    fwd_edges = set(map(tuple, topology.fwd_edges))
    grad_edges = set(map(tuple, topology.grad_edges))
    seen: dict[tuple, tuple] = {}  # (stage, kind, mb) -> (rank, pos)
    comm_seen: dict[Action, tuple] = {}
    for rank in sorted(lowered):
        done: set = set()  # keys produced so far on this rank, plus comm actions posted
        for pos, a in enumerate(lowered[rank]):
            where = _where(rank, pos, a)
            if not 0 <= a.stage < num_stages:
                raise ScheduleError(f"{where}: stage {a.stage} does not exist ({num_stages} stages)")
            if stage_to_rank[a.stage] != rank:
                raise ScheduleError(
                    f"{where}: stage {a.stage} lives on rank {stage_to_rank[a.stage]}, not rank {rank}")
            if not 0 <= a.mb < num_microbatches:
                raise ScheduleError(
                    f"{where}: microbatch {a.mb} out of range ({num_microbatches} microbatches)")
            if not training and a.kind not in ("F", "SEND_F", "RECV_F"):
                raise ScheduleError(f"{where}: a forward-only plan has no backward or gradient traffic")
            if a.is_comm:
                if a.peer is None:
                    raise ScheduleError(f"{where}: comm action without a peer stage (resolve peers first)")
                if not 0 <= a.peer < num_stages:
                    raise ScheduleError(f"{where}: peer stage {a.peer} does not exist")
                edge = {"SEND_F": (a.stage, a.peer), "RECV_F": (a.peer, a.stage),
                        "SEND_B": (a.peer, a.stage), "RECV_B": (a.stage, a.peer)}[a.kind]
                edges = fwd_edges if a.kind.endswith("F") else grad_edges
                if edge not in edges:
                    what = "activation" if a.kind.endswith("F") else "gradient"
                    raise ScheduleError(f"{where}: there is no {what} edge {edge} in the topology")
                if stage_to_rank[a.peer] == rank:
                    raise ScheduleError(
                        f"{where}: stages {a.stage} and {a.peer} share rank {rank}; "
                        f"they pass values in memory, not by send/recv")
                if a in comm_seen:
                    r0, p0 = comm_seen[a]
                    raise ScheduleError(f"{where}: duplicate of rank {r0}, action {p0}")
                comm_seen[a] = (rank, pos)
                if a.kind == "SEND_F" and (a.stage, "F", a.mb) not in done:
                    raise ScheduleError(f"{where}: sends activations before '{a.stage}F{a.mb}' has run")
                if a.kind == "SEND_B" and (a.stage, INPUT_GRAD, a.mb) not in done:
                    raise ScheduleError(
                        f"{where}: sends a gradient before the backward (B or I) of stage {a.stage} "
                        f"microbatch {a.mb} has run")
                done.add(a)
                continue
            # compute action
            key = (a.stage, INPUT_GRAD if a.kind in ("B", "I") else a.kind, a.mb)
            if key in seen:
                r0, p0 = seen[key]
                name = "backward (B or I)" if key[1] == INPUT_GRAD else a.kind
                raise ScheduleError(
                    f"{where}: duplicate {name} of stage {a.stage} microbatch {a.mb} "
                    f"(first at rank {r0}, action {p0})")
            seen[key] = (rank, pos)
            if a.kind == "W":
                i_pos = seen.get((a.stage, INPUT_GRAD, a.mb))
                if i_pos is None or lowered[rank][i_pos[1]].kind != "I":
                    raise ScheduleError(
                        f"{where}: weight-grad W runs before the input-grad '{a.stage}I{a.mb}'")
            for dep in compute_deps(a, topology):
                if dep[0] == a.stage or stage_to_rank[dep[0]] == rank:
                    if dep not in done:
                        need = f"{dep[0]}{'F' if dep[1] == 'F' else 'B/I'}{dep[2]}"
                        raise ScheduleError(f"{where}: needs '{need}' on this rank first, which has not run")
                else:
                    recv = recv_for(dep, a.stage)
                    if recv not in done:
                        what = "input" if dep[1] == "F" else "gradient"
                        raise ScheduleError(
                            f"{where}: its {what} from stage {dep[0]} ({recv.kind} '{recv}') has not arrived")
            done.add(produced_key(a))
    # completeness
    for s in range(num_stages):
        r = stage_to_rank[s]
        for m in range(num_microbatches):
            if (s, "F", m) not in seen:
                raise ScheduleError(f"stage {s} microbatch {m} has no F (expected on rank {r})")
            if training:
                g = seen.get((s, INPUT_GRAD, m))
                if g is None:
                    raise ScheduleError(f"stage {s} microbatch {m} has no backward (B or I) (expected on rank {r})")
                is_i = lowered[g[0]][g[1]].kind == "I"
                has_w = (s, "W", m) in seen
                if is_i and not has_w:
                    raise ScheduleError(f"stage {s} microbatch {m} has I but no W (rank {r})")
                if not is_i and has_w:
                    w = seen[(s, "W", m)]
                    raise ScheduleError(
                        f"{_where(w[0], w[1], lowered[w[0]][w[1]])}: stage {s} microbatch {m} "
                        f"has a full B and a W")
    # every cross-rank edge: exactly one send and one recv, in matching order per rank pair
    expected = []
    for (i, j) in sorted(fwd_edges):
        if stage_to_rank[i] != stage_to_rank[j]:
            for m in range(num_microbatches):
                expected.append((Action(i, "SEND_F", m, j), Action(j, "RECV_F", m, i)))
    if training:
        for (i, j) in sorted(grad_edges):
            if stage_to_rank[i] != stage_to_rank[j]:
                for m in range(num_microbatches):
                    expected.append((Action(j, "SEND_B", m, i), Action(i, "RECV_B", m, j)))
    for send, recv in expected:
        has_send, has_recv = send in comm_seen, recv in comm_seen
        if has_send and not has_recv:
            r, p = comm_seen[send]
            raise ScheduleError(f"{_where(r, p, send)}: no matching '{recv}' on rank {stage_to_rank[recv.stage]}")
        if has_recv and not has_send:
            r, p = comm_seen[recv]
            raise ScheduleError(f"{_where(r, p, recv)}: no matching '{send}' on rank {stage_to_rank[send.stage]}")
        if not has_send:
            raise ScheduleError(
                f"missing '{send}' on rank {stage_to_rank[send.stage]} and '{recv}' on rank "
                f"{stage_to_rank[recv.stage]}")
    channels = _channels(lowered, stage_to_rank)
    for (src, dst), (sends, recvs) in sorted(channels.items()):
        for n, ((sp, s), (rp, r)) in enumerate(zip(sends, recvs)):
            if _counterpart(s) != r:
                raise ScheduleError(
                    f"rank pair {src}->{dst}: send #{n} on rank {src} is '{s}' (action {sp}) but receive #{n} "
                    f"on rank {dst} is '{r}' (action {rp}); NCCL matches sends and receives in issue order, "
                    f"so both ranks must list them in the same order")


def _counterpart(a: Action) -> Action:
    return Action(a.peer, {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[a.kind],
                  a.mb, a.stage)


def _channels(lowered, stage_to_rank):
    """(src rank, dst rank) -> ([(pos, send)...], [(pos, recv)...]) in list order."""
    channels: dict[tuple, tuple] = {}
    for rank in sorted(lowered):
        for pos, a in enumerate(lowered[rank]):
            if not a.is_comm:
                continue
            peer_rank = stage_to_rank[a.peer]
            if a.kind.startswith("SEND"):
                channels.setdefault((rank, peer_rank), ([], []))[0].append((pos, a))
            else:
                channels.setdefault((peer_rank, rank), ([], []))[1].append((pos, a))
    return channels


# ----------------------------------------------------------------------------------------------------
# the execution engine (shared by validate and simulate)

@dataclass
class _Batch:
    rank: int
    first_pos: int
    ops: list  # comm actions
    posted: Optional[float] = None
    head: Optional[float] = None  # time it reached the head of its queue
    done: Optional[float] = None


def _execute(lowered, stage_to_rank, topology, costs):
    """Run the strict model. Returns (compute timeline per rank, batches per rank); raises on deadlock."""
    ranks = sorted(lowered)
    items: dict[int, list] = {}
    batch_of: dict[Action, _Batch] = {}
    for r in ranks:
        seq, cur = [], None
        for pos, a in enumerate(lowered[r]):
            if a.is_comm:
                if cur is None:
                    cur = _Batch(r, pos, [])
                    seq.append(cur)
                cur.ops.append(a)
                batch_of[a] = cur
            else:
                cur = None
                seq.append((pos, a))
        items[r] = seq
    # per channel: op -> counterpart op, by issue order
    partner: dict[Action, Action] = {}
    for (src, dst), (sends, recvs) in _channels(lowered, stage_to_rank).items():
        for (_, s), (_, rv) in zip(sends, recvs):
            partner[s], partner[rv] = rv, s
    pc = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    queue: dict[int, list] = {r: [] for r in ranks}
    last_done = {r: 0.0 for r in ranks}
    timeline: dict[int, list] = {r: [] for r in ranks}
    all_batches: dict[int, list] = {r: [] for r in ranks}
    blocked_on: dict[int, Action] = {}

    def set_head(r):
        if queue[r]:
            b = queue[r][0]
            if b.head is None:
                b.head = max(b.posted, last_done[r])

    progress = True
    while progress:
        progress = False
        for r in ranks:
            seq = items[r]
            while pc[r] < len(seq):
                item = seq[pc[r]]
                if isinstance(item, _Batch):
                    item.posted = clock[r]
                    queue[r].append(item)
                    all_batches[r].append(item)
                    set_head(r)
                    pc[r] += 1
                    progress = True
                    continue
                pos, a = item
                start = clock[r]
                waiting = None
                for dep in compute_deps(a, topology):
                    if stage_to_rank[dep[0]] != r:
                        b = batch_of[recv_for(dep, a.stage)]
                        if b.done is None:
                            waiting = recv_for(dep, a.stage)
                            break
                        start = max(start, b.done)
                if waiting is not None:
                    blocked_on[r] = waiting
                    break
                blocked_on.pop(r, None)
                end = start + cost_of(a, costs)
                timeline[r].append((pos, a, start, end))
                clock[r] = end
                pc[r] += 1
                progress = True
        # comm fixpoint
        changed = True
        while changed:
            changed = False
            for r in ranks:
                if not queue[r]:
                    continue
                b = queue[r][0]
                t = b.head
                ok = True
                for op in b.ops:
                    other = partner.get(op)
                    ob = batch_of.get(other) if other is not None else None
                    if ob is None or ob.head is None:
                        ok = False
                        break
                    t = max(t, ob.head)
                if ok:
                    b.done = t
                    last_done[r] = t
                    queue[r].pop(0)
                    set_head(r)
                    changed = progress = True
    stuck = [r for r in ranks if pc[r] < len(items[r]) or queue[r]]
    if stuck:
        parts = []
        for r in stuck:
            if queue[r]:
                b = queue[r][0]
                bad = next(op for op in b.ops
                           if partner.get(op) is None or batch_of[partner[op]].head is None)
                other = partner.get(bad)
                if other is None:
                    why = "no counterpart"
                else:
                    why = f"rank {stage_to_rank[other.stage]} has not reached '{other}'"
                parts.append(f"rank {r} waits at action {lowered[r].index(bad)} '{bad}' ({why})")
            else:
                pos, a = items[r][pc[r]]
                need = blocked_on.get(r)
                parts.append(f"rank {r} waits at action {pos} '{a}' (for '{need}')")
        raise ScheduleError("deadlock: " + ", ".join(parts))
    return timeline, all_batches


# ----------------------------------------------------------------------------------------------------
# public API

def check_compute(compute: dict, stage_to_rank: list, topology: Topology, num_microbatches: int,
                  training: bool = True) -> None:
    """Static checks of *compute-only* per-rank lists (a user's CSV) before they are lowered.

    Catches what would otherwise surface only as a deadlock of the lowering: a duplicated action, a W or
    backward before what it needs on the same rank, a stage/microbatch without its F, backward or W.
    Per-rank checks run rank by rank, position by position, so the message names the first bad action.
    """
    num_stages = len(stage_to_rank)
    seen: dict[tuple, tuple] = {}  # (stage, 'F'|INPUT_GRAD|'W', mb) -> (rank, pos)
    for rank in sorted(compute):
        done: set = set()
        for pos, a in enumerate(compute[rank]):
            where = _where(rank, pos, a)
            if a.is_comm:
                raise ScheduleError(f"{where}: a compute-only list cannot hold comm actions; give every comm "
                                    f"action (a lowered plan) or none")
            if not 0 <= a.stage < num_stages or stage_to_rank[a.stage] != rank:
                home = f"rank {stage_to_rank[a.stage]}" if 0 <= a.stage < num_stages else "no rank"
                raise ScheduleError(f"{where}: stage {a.stage} lives on {home}, not rank {rank}")
            if not 0 <= a.mb < num_microbatches:
                raise ScheduleError(f"{where}: microbatch {a.mb} out of range ({num_microbatches} microbatches: "
                                    f"0..{num_microbatches - 1}); check --microbatches")
            if not training and a.kind != "F":
                raise ScheduleError(f"{where}: the model has no loss_fn (forward only), so the plan may hold "
                                    f"only F actions")
            key = produced_key(a)
            if key in seen:
                r0, p0 = seen[key]
                name = "backward (B or I)" if key[1] == INPUT_GRAD else a.kind
                raise ScheduleError(f"{where}: duplicate {name} of stage {a.stage} microbatch {a.mb} (first at "
                                    f"rank {r0}, action {p0} '{compute[r0][p0]}'); remove one of them")
            if a.kind == "W":
                g = seen.get((a.stage, INPUT_GRAD, a.mb))
                if g is None or g[0] != rank:
                    raise ScheduleError(f"{where}: weight-grad W before the input-grad '{a.stage}I{a.mb}'; "
                                        f"put '{a.stage}I{a.mb}' earlier on rank {rank}")
                if compute[g[0]][g[1]].kind == "B":
                    raise ScheduleError(f"{where}: stage {a.stage} microbatch {a.mb} already has a full backward "
                                        f"'{compute[g[0]][g[1]]}' (rank {g[0]}, action {g[1]}); use I + W or B")
            for dep in compute_deps(a, topology):
                if stage_to_rank[dep[0]] == rank and dep not in done:
                    kinds = ("F",) if dep[1] == "F" else ("B", "I")
                    later = next((p for p in range(pos + 1, len(compute[rank]))
                                  if compute[rank][p] in [Action(dep[0], k, dep[2]) for k in kinds]), None)
                    if later is not None:
                        raise ScheduleError(f"{where}: needs '{compute[rank][later]}' (action {later}) to run "
                                            f"first; move it before action {pos}")
                    need = " or ".join(f"'{dep[0]}{k}{dep[2]}'" for k in kinds)
                    raise ScheduleError(f"{where}: needs {need} first, which rank {rank} never runs; add it "
                                        f"before action {pos}")
            seen[key] = (rank, pos)
            done.add(key)
    for s in range(num_stages):
        r = stage_to_rank[s]
        for m in range(num_microbatches):
            if (s, "F", m) not in seen:
                raise ScheduleError(f"stage {s} microbatch {m} has no forward: add '{s}F{m}' to rank {r}")
            if not training:
                continue
            g = seen.get((s, INPUT_GRAD, m))
            if g is None:
                raise ScheduleError(f"stage {s} microbatch {m} has no backward: add '{s}B{m}' (or '{s}I{m}' and "
                                    f"'{s}W{m}') to rank {r}")
            if compute[g[0]][g[1]].kind == "I" and (s, "W", m) not in seen:
                raise ScheduleError(f"rank {g[0]}, action {g[1]} '{compute[g[0]][g[1]]}': input-grad without "
                                    f"its weight-grad: add '{s}W{m}' after it")


def validate(lowered: dict, stage_to_rank: list, topology: Topology, num_microbatches: int,
             training: bool = True) -> None:
    """Raise :class:`ScheduleError` unless ``lowered`` is a complete, deadlock-free plan (see module doc)."""
    lowered = {r: list(v) for r, v in lowered.items()}
    for r in set(stage_to_rank):
        lowered.setdefault(r, [])
    _static_checks(lowered, list(stage_to_rank), topology, num_microbatches, training)
    _execute(lowered, list(stage_to_rank), topology, None)


@dataclass
class SimResult:
    """Timeline of one plan under the strict execution model (comms cost 0).

    ``timeline[rank]`` lists ``(action, start, end)`` for compute actions in execution order;
    ``comm[rank]`` lists ``(actions, posted, completed)`` per comm batch. ``bubble[rank]`` is
    idle/makespan; ``bubble_overall`` is total idle over ``num_ranks * makespan``. ``peak_inflight[rank]``
    counts (stage, microbatch) pairs whose F has run and whose backward (B or I) has not.
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

    @property
    def num_ranks(self) -> int:
        return len(self.timeline)


def simulate(lowered: dict, stage_to_rank: list, topology: Topology, num_microbatches: int,
             costs: Optional[dict] = None, training: Optional[bool] = None) -> SimResult:
    """Validate, then time ``lowered`` with compute ``costs`` (default F=1, B=2, I=1, W=1; comms 0)."""
    lowered = {r: list(v) for r, v in lowered.items()}
    for r in set(stage_to_rank):
        lowered.setdefault(r, [])
    if training is None:
        training = any(a.kind in ("B", "I", "W") for acts in lowered.values() for a in acts)
    _static_checks(lowered, list(stage_to_rank), topology, num_microbatches, training)
    raw, batches = _execute(lowered, list(stage_to_rank), topology, costs)
    timeline = {r: [(a, s, e) for _, a, s, e in raw[r]] for r in sorted(raw)}
    comm = {r: [(list(b.ops), b.posted, b.done) for b in batches[r]] for r in sorted(batches)}
    makespan = max([e for tl in timeline.values() for _, _, e in tl] + [0.0])
    busy = {r: sum(e - s for _, s, e in tl) for r, tl in timeline.items()}
    bubble = {r: (1.0 - busy[r] / makespan) if makespan > 0 else 0.0 for r in timeline}
    total = makespan * len(timeline)
    bubble_overall = (1.0 - sum(busy.values()) / total) if total > 0 else 0.0
    peak = {}
    for r, tl in timeline.items():
        live: set = set()
        best = 0
        for a, _, _ in tl:
            if a.kind == "F":
                live.add((a.stage, a.mb))
            elif a.kind in ("B", "I"):
                live.discard((a.stage, a.mb))
            best = max(best, len(live))
        peak[r] = best
    used = dict(DEFAULT_COSTS)
    if costs:
        used.update(costs)
    return SimResult(list(stage_to_rank), num_microbatches, timeline, comm, makespan, busy, bubble,
                     bubble_overall, peak, used)
