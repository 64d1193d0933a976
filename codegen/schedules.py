"""Pipeline schedules as pure functions: per-rank *compute-only* action lists.

Names (``SCHEDULES``):

* ``gpipe`` — one stage per rank; all forwards, then all full backwards.
* ``1f1b`` — one stage per rank; ``min(p - r - 1, m)`` warm-up forwards on rank r, then one forward /
  one backward alternately, then the remaining backwards.
* ``interleaved-1f1b`` — several stages per rank in loop placement (Megatron-style): microbatches go in
  ``m // p`` groups of ``p`` to ``2p - 1`` (as even as possible); each group runs through the rank's first
  stage, then its next one, ...; warm-up ``2(p - r - 1) + (v - 1) * group size`` forwards. Any ``m >= p``
  (a short last group of fewer than ``p`` microbatches would deadlock). One stage per rank = 1f1b.
* ``looped-bfs`` — several stages per rank in loop placement; breadth first: every microbatch through the
  rank's first stage, then its next stage...; backwards in reverse.
* ``interleaved-zb`` — the interleaved-1f1b order with each backward split into I (input grad) and W
  (weight grad); a W fills only a slot where the next action would wait, so peak activations equal
  interleaved-1f1b's (ZB-H1).
* ``zbv`` — two stages per rank in V placement; a greedy list schedule (priority: input-grad I, then
  forward of the rank's deeper stage, then forward of its first stage while fewer than ``2p`` (stage,
  microbatch) activations are live), with W's filling idle slots (the ZB-V idea).
* ``dualpipev`` — DeepSeek's DualPipeV phases for ``m >= 2p`` (full backwards B in the steady state,
  where DualPipeV overlaps an F with a B of the other leg — listed here one after the other — and split
  I/W in the warm-up and cool-down). With ``m < 2p`` it falls back to the greedy V schedule above, using
  full backwards while the rank still has forwards to run and I/W in the cool-down.

Costs used to place the deferred W's and to drive the greedy V schedules: F=1, I=1, W=1 (B=2).
With ``training=False`` every schedule yields only its forwards.
"""
from __future__ import annotations

from .actions import Action, Topology
from .simulate import compute_deps, cost_of, produced_key

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")

_SINGLE = ("gpipe", "1f1b")
_V = ("zbv", "dualpipev")


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}")


def placement_style(schedule: str) -> str:
    """``"v"`` for zbv/dualpipev, ``"loop"`` otherwise."""
    _check_name(schedule)
    return "v" if schedule in _V else "loop"


def placement(schedule: str, num_ranks: int, num_stages: int) -> list[int]:
    """Stage -> rank map for ``schedule``; raises ValueError for combos it cannot run.

    "loop": rank r holds stages r, r+R, r+2R, ...; "v": rows of R stages alternate direction, so with two
    rows rank r holds r and 2R-1-r (consecutive stages R-1 and R share the last rank).
    """
    _check_name(schedule)
    if num_ranks < 1 or num_stages < 1:
        raise ValueError(f"schedule {schedule!r}: need at least 1 rank and 1 stage; got {num_stages} "
                         f"stages on {num_ranks} ranks")
    if schedule in _SINGLE and num_stages != num_ranks:
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank; got {num_stages} stages on {num_ranks} ranks: "
            f"use --schedule interleaved-1f1b or --stages {num_ranks}")
    if schedule in _V and num_stages != 2 * num_ranks:
        raise ValueError(
            f"schedule {schedule!r} runs exactly 2 stages per rank (a V); got {num_stages} stages on "
            f"{num_ranks} ranks: use --stages {2 * num_ranks}")
    if num_stages % num_ranks:
        lo = max(num_ranks, num_stages // num_ranks * num_ranks)
        raise ValueError(
            f"schedule {schedule!r} needs the number of stages to be a multiple of the number of ranks; "
            f"got {num_stages} stages on {num_ranks} ranks: use --stages {lo} or --stages {lo + num_ranks}")
    if schedule in _V:
        out = []
        for s in range(num_stages):
            row, col = divmod(s, num_ranks)
            out.append(col if row % 2 == 0 else num_ranks - 1 - col)
        return out
    return [s % num_ranks for s in range(num_stages)]


def rank_stages(stage_to_rank: list[int]) -> dict[int, list[int]]:
    """rank -> its stages, ascending."""
    out: dict[int, list[int]] = {r: [] for r in sorted(set(stage_to_rank))}
    for s, r in enumerate(stage_to_rank):
        out[r].append(s)
    return out


def _check_microbatches(schedule, num_ranks, num_stages, num_microbatches):
    if num_microbatches < 1:
        raise ValueError(f"schedule {schedule!r}: need at least 1 microbatch; got {num_microbatches}")
    if schedule in ("interleaved-1f1b", "interleaved-zb") and num_stages > num_ranks \
            and num_microbatches < num_ranks:
        raise ValueError(
            f"schedule {schedule!r} needs at least as many microbatches as ranks; got {num_microbatches} "
            f"microbatches on {num_ranks} ranks: use --microbatches {num_ranks} or more "
            f"(or --schedule looped-bfs)")


# ----------------------------------------------------------------------------------------------------
# static orders

def _gpipe(num_ranks, num_microbatches):
    return {r: [Action(r, "F", m) for m in range(num_microbatches)]
            + [Action(r, "B", m) for m in range(num_microbatches)] for r in range(num_ranks)}


def _one_f_one_b(num_ranks, num_microbatches, bwd="B"):
    out = {}
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, num_microbatches)
        acts = [Action(r, "F", m) for m in range(warmup)]
        for k in range(num_microbatches - warmup):
            acts.append(Action(r, "F", warmup + k))
            acts.append(Action(r, bwd, k))
        acts += [Action(r, bwd, k) for k in range(num_microbatches - warmup, num_microbatches)]
        out[r] = acts
    return out


def _interleaved(num_ranks, num_stages, num_microbatches, bwd="B"):
    """Megatron-style interleaved 1F1B over chunk groups of ``num_ranks`` microbatches (any m >= p)."""
    p, v, m = num_ranks, num_stages // num_ranks, num_microbatches
    if v == 1:
        return _one_f_one_b(num_ranks, num_microbatches, bwd)
    # split the microbatches into m // p groups of p..2p-1 (sizes as even as possible, larger first)
    num_groups = m // p
    sizes = [m // num_groups + (1 if g < m % num_groups else 0) for g in range(num_groups)]
    fwd_order, bwd_order = [], []  # (chunk, mb) in the order every rank visits them
    first = 0
    for size in sizes:
        group = range(first, first + size)
        first += size
        for c in range(v):
            fwd_order += [(c, mb) for mb in group]
            bwd_order += [(v - 1 - c, mb) for mb in group]
    out = {}
    for r in range(p):
        total = len(fwd_order)
        warmup = min((p - r - 1) * 2 + (v - 1) * sizes[0], total)
        acts = [Action(c * p + r, "F", mb) for c, mb in fwd_order[:warmup]]
        for k in range(total - warmup):
            c, mb = fwd_order[warmup + k]
            acts.append(Action(c * p + r, "F", mb))
            c, mb = bwd_order[k]
            acts.append(Action(c * p + r, bwd, mb))
        acts += [Action(c * p + r, bwd, mb) for c, mb in bwd_order[total - warmup:]]
        out[r] = acts
    return out


def _looped_bfs(num_ranks, num_stages, num_microbatches):
    out = {}
    for r in range(num_ranks):
        stages = list(range(r, num_stages, num_ranks))
        acts = [Action(s, "F", m) for s in stages for m in range(num_microbatches)]
        acts += [Action(s, "B", m) for s in reversed(stages) for m in range(num_microbatches)]
        out[r] = acts
    return out


# ----------------------------------------------------------------------------------------------------
# timed list scheduling (zero-bubble variants)

class _ListScheduler:
    """Builds per-rank orders by replaying time with unit costs: a rank, when free, picks what to run next.

    ``pick(rank, now)`` returns the action to run, or None to wait. Actions whose inputs are not yet
    scheduled are never offered. Ranks are served earliest-clock first, so a decision at time t sees every
    action that can end by t.
    """

    def __init__(self, stage_to_rank, topology, costs=None):
        self.stage_to_rank = stage_to_rank
        self.topology = topology
        self.costs = costs or {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
        self.ready: dict[tuple, float] = {}  # key -> end time
        self.orders: dict[int, list] = {r: [] for r in sorted(set(stage_to_rank))}
        self.clock = {r: 0.0 for r in self.orders}

    def ready_time(self, action):
        """When ``action``'s inputs are all available, or None if some are not yet scheduled."""
        t = 0.0
        for d in compute_deps(action, self.topology):
            if d not in self.ready:
                return None
            t = max(t, self.ready[d])
        return t

    def run(self, rank, action, now):
        t = max(now, self.ready_time(action))
        end = t + cost_of(action, self.costs)
        self.ready[produced_key(action)] = end
        self.orders[rank].append(action)
        self.clock[rank] = end

    def drive(self, pick, done):
        """``pick(rank, now) -> (action | None, wait_until | None)``; ``done(rank) -> bool``."""
        while True:
            live = [r for r in self.orders if not done(r)]
            if not live:
                return self.orders
            acted = False
            for r in sorted(live, key=lambda r: (self.clock[r], r)):
                action, wait_until = pick(r, self.clock[r])
                if action is not None:
                    self.run(r, action, self.clock[r])
                    acted = True
                    break
                if wait_until is not None:
                    self.clock[r] = max(self.clock[r], wait_until)
                    acted = True
                    break
            if not acted:
                raise RuntimeError("internal error: schedule generator stalled")  # pragma: no cover


def _fill_weights(static: dict, stage_to_rank, topology, w_limit):
    """Keep the static F/I order per rank; insert each I's W when the next static action would wait, or
    when more than ``w_limit`` W's are pending; flush the rest at the end."""
    sched = _ListScheduler(stage_to_rank, topology)
    idx = {r: 0 for r in static}
    pending: dict[int, list] = {r: [] for r in static}

    def pick(r, now):
        if pending[r] and (len(pending[r]) > w_limit or idx[r] >= len(static[r])):
            return pending[r].pop(0), None
        if idx[r] < len(static[r]):
            a = static[r][idx[r]]
            t = sched.ready_time(a)
            if t is not None and t <= now:
                idx[r] += 1
                if a.kind == "I":
                    pending[r].append(Action(a.stage, "W", a.mb))
                return a, None
            if pending[r]:
                return pending[r].pop(0), None
            return None, t
        return None, None

    return sched.drive(pick, lambda r: idx[r] >= len(static[r]) and not pending[r])


def _greedy_v(stage_to_rank, topology, num_microbatches, full_backward_until_cooldown, w_limit):
    """Greedy V-placement schedule (see module doc)."""
    sched = _ListScheduler(stage_to_rank, topology)
    stages = rank_stages(stage_to_rank)
    m = num_microbatches
    next_f = {s: 0 for s in range(len(stage_to_rank))}
    next_b = {s: 0 for s in range(len(stage_to_rank))}
    pending: dict[int, list] = {r: [] for r in stages}
    cap = 2 * len(stages)

    def live(r):
        return sum(next_f[s] - next_b[s] for s in stages[r])

    def pick(r, now):
        if len(pending[r]) > w_limit:
            return pending[r].pop(0), None
        f_left = any(next_f[s] < m for s in stages[r])
        cands = []
        for s in stages[r]:
            if next_b[s] < next_f[s]:  # backwards in microbatch order per stage
                kind = "B" if (full_backward_until_cooldown and f_left) else "I"
                cands.append((0, next_b[s], -s, Action(s, kind, next_b[s])))
        deep_first = sorted(stages[r], reverse=True)
        for rank_in_v, s in enumerate(deep_first):
            if next_f[s] < m:
                first_stage = s == min(stages[r])
                if first_stage and live(r) >= cap:
                    continue
                cands.append((1 + rank_in_v, next_f[s], -s, Action(s, "F", next_f[s])))
        cands.sort()
        waits = []
        for *_, a in cands:
            t = sched.ready_time(a)
            if t is None:
                continue
            if t <= now:
                (next_f if a.kind == "F" else next_b)[a.stage] += 1
                if a.kind == "I":
                    pending[r].append(Action(a.stage, "W", a.mb))
                return a, None
            waits.append(t)
        if pending[r]:
            return pending[r].pop(0), None
        return None, (min(waits) if waits else None)

    def done(r):
        return all(next_b[s] >= m for s in stages[r]) and not pending[r]

    return sched.drive(pick, done)


def _dualpipev(num_ranks, num_microbatches):
    """DualPipeV phases (DeepSeek's DualPipe folded into a V), for ``m >= 2p``.

    Rank r holds stage ``a = r`` (down leg) and ``b = 2p-1-r`` (up leg). Phases: forwards of a to fill the
    V; forward pairs (a, b); I/W/F of b; the steady state of F/B pairs (F a + B b, F b + B a: the pairs
    DualPipeV overlaps, listed here one after the other); drain of b; backward pairs that switch to split
    I/W halfway (odd ranks one step earlier); and the W's left over.
    """
    p, m = num_ranks, num_microbatches
    out = {}
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        nxt = {(a, "F"): 0, (b, "F"): 0, (a, "backward"): 0, (b, "backward"): 0}
        acts: list[Action] = []
        weights: list[Action] = []

        def fwd(s):
            acts.append(Action(s, "F", nxt[(s, "F")]))
            nxt[(s, "F")] += 1

        def bwd(s, split):
            mb = nxt[(s, "backward")]
            nxt[(s, "backward")] += 1
            acts.append(Action(s, "I" if split else "B", mb))
            if split:
                weights.append(Action(s, "W", mb))

        def weight():
            if weights:
                acts.append(weights.pop(0))

        for _ in range(2 * (p - r - 1)):
            fwd(a)
        for _ in range(r + 1):
            fwd(a)
            fwd(b)
        for _ in range(p - r - 1):
            bwd(b, split=True)
            weight()
            fwd(b)
        for _ in range(m - 2 * p + r + 1):
            fwd(a)
            bwd(b, split=False)
            fwd(b)
            bwd(a, split=False)
        for _ in range(p - r - 1):
            bwd(b, split=False)
            fwd(b)
            bwd(a, split=False)
        split = False
        half = (r + 1) // 2
        for k in range(r + 1):
            if k == half and r % 2 == 1:
                split = True
            bwd(b, split)
            if k == half and r % 2 == 0:
                split = True
            bwd(a, split)
        for _ in range(p - r - 1):
            weight()
            bwd(a, split)
        while weights:
            weight()
        out[r] = acts
    return out


# ----------------------------------------------------------------------------------------------------

def generate(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int,
             training: bool = True, topology: Topology | None = None) -> dict[int, list[Action]]:
    """Per-rank compute-only action lists for ``schedule`` (see module doc).

    ``topology`` defaults to a chain; the static schedules do not depend on it, the timed ones
    (interleaved-zb, zbv, dualpipev) use it to see when inputs are ready.
    """
    stage_to_rank = placement(schedule, num_ranks, num_stages)
    _check_microbatches(schedule, num_ranks, num_stages, num_microbatches)
    topology = topology or Topology.chain(num_stages)
    m = num_microbatches
    if schedule == "gpipe":
        out = _gpipe(num_ranks, m)
    elif schedule == "1f1b":
        out = _one_f_one_b(num_ranks, m)
    elif schedule == "interleaved-1f1b":
        out = _interleaved(num_ranks, num_stages, m)
    elif schedule == "looped-bfs":
        out = _looped_bfs(num_ranks, num_stages, m)
    elif schedule == "interleaved-zb":
        if not training:
            out = _interleaved(num_ranks, num_stages, m)
        else:
            # ZB-H1: a W fills only a slot where the next action would wait (w_limit=0), so no more
            # activations are alive at once than in interleaved 1F1B, while the bubble still shrinks
            out = _fill_weights(_interleaved(num_ranks, num_stages, m, bwd="I"), stage_to_rank, topology,
                                w_limit=0)
    elif schedule == "dualpipev" and m >= 2 * num_ranks:
        out = _dualpipev(num_ranks, m)
    else:  # zbv; dualpipev with fewer than 2p microbatches
        out = _greedy_v(stage_to_rank, topology, m, full_backward_until_cooldown=(schedule == "dualpipev"),
                        w_limit=num_ranks)
    if not training:
        out = {r: [a for a in acts if a.kind == "F"] for r, acts in out.items()}
    return {r: out.get(r, []) for r in range(num_ranks)}
