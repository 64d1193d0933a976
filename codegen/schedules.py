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
* ``interleaved-zb`` — the interleaved-1f1b order with backwards split into I (input grad) and W (weight
  grad), each W run right after its own I: the input gradient goes to the previous stage a W earlier than a
  full backward would send it, and no W is held back past other work, so peak activations equal
  interleaved-1f1b's. A split stays only where that earlier gradient shortens the step; every other backward
  is one full B (see :func:`_fuse_free_splits`: on 2 ranks, 4 stages and 8 microbatches, 3 of 32 stay split).
  (Letting one W wait while the next F or I is ready shortens the simulated step by one unit cost, 1.6% of the
  quick suite's 2-rank step, for one more microbatch's weight-gradient inputs held per rank.)
* ``zbv`` — two stages per rank in V placement; a greedy list schedule (priority: input-grad I, then
  forward of the rank's deeper stage, then forward of its first stage while fewer than ``2p`` (stage,
  microbatch) activations are live), with W's filling idle slots (the ZB-V idea). A W that lands right after its
  own I, where the earlier input gradient shortens nothing, is fused with it into one B (as in interleaved-zb).
* ``dualpipev`` — DeepSeek's DualPipeV phases for ``m >= 2p`` (full backwards B in the steady state,
  where DualPipeV overlaps an F with a B of the other leg — listed here one after the other — and split
  I/W in the warm-up and cool-down; a pair whose W follows its I at once and buys nothing is one B). With
  ``m < 2p`` it falls back to the greedy V schedule above, using full backwards while the rank still has forwards
  to run and I/W in the cool-down.

The table :data:`SCHEDULE_TABLE` holds what the rest of tracepp knows about each name: its placement, stages
per rank by default and allowed, whether it splits backwards into I and W, and its microbatch constraint.

The timed schedules (interleaved-zb's W placement, zbv, dualpipev with few microbatches) are policies that
drive the one replay engine (``runtime.replay``) with its unit costs (F=1, I=1, W=1, B=2): a rank, when free,
picks what to run next among the actions whose inputs are made. With ``training=False`` every schedule yields
only its forwards.
"""
from __future__ import annotations

from typing import NamedTuple

from tracepp.runtime.actions import Action, Topology
from tracepp.runtime.replay import Replay, Wait, grad_producers, replay


class ScheduleInfo(NamedTuple):
    """What tracepp knows about one named schedule.

    ``placement``: "loop" (rank r holds stages r, r+R, r+2R, ...) or "v" (rows of R stages alternate direction).
    ``stages_per_rank``: the default number of stages per rank (when neither --stages nor split points say).
    ``stage_counts``: "one" (exactly one stage per rank), "two" (exactly two) or "multiple" (any multiple of the
    ranks). ``split_backward``: in training, (some) backwards are split into I (input grad) and W (weight grad).
    ``microbatches_per_rank``: with several stages per rank, at least this many microbatches per rank.
    """

    placement: str
    stages_per_rank: int
    stage_counts: str
    split_backward: bool
    microbatches_per_rank: int = 0


SCHEDULE_TABLE = {
    "gpipe": ScheduleInfo("loop", 1, "one", False),
    "1f1b": ScheduleInfo("loop", 1, "one", False),
    "interleaved-1f1b": ScheduleInfo("loop", 2, "multiple", False, microbatches_per_rank=1),
    "looped-bfs": ScheduleInfo("loop", 2, "multiple", False),
    "interleaved-zb": ScheduleInfo("loop", 2, "multiple", True, microbatches_per_rank=1),
    "zbv": ScheduleInfo("v", 2, "two", True),
    "dualpipev": ScheduleInfo("v", 2, "two", True),
}
SCHEDULES = tuple(SCHEDULE_TABLE)


def schedule_info(schedule: str) -> ScheduleInfo:
    """The table's row for ``schedule``; ValueError listing the valid names for any other."""
    if schedule not in SCHEDULE_TABLE:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}, "
                         f"or a path to a .csv file")
    return SCHEDULE_TABLE[schedule]


def is_csv(schedule: str) -> bool:
    return str(schedule).lower().endswith(".csv")


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds by default: the table's number, one for a CSV (its rows say)."""
    return 1 if is_csv(schedule) else schedule_info(schedule).stages_per_rank


def placement_style(schedule: str) -> str:
    """``"v"`` or ``"loop"``, from the table."""
    return schedule_info(schedule).placement


def check_stages_divide(num_stages: int, num_ranks: int) -> None:
    """The one check (and message) that every rank holds the same number of stages."""
    if num_stages % num_ranks:
        lo = max(num_ranks, num_stages // num_ranks * num_ranks)
        raise ValueError(f"{num_stages} stages cannot be spread evenly over {num_ranks} ranks: use --stages "
                         f"a multiple of --ranks {num_ranks} (e.g. --stages {lo} or {lo + num_ranks}), or split "
                         f"points that make such a number of stages")


def placement(schedule: str, num_ranks: int, num_stages: int) -> list[int]:
    """Stage -> rank map for ``schedule``; raises ValueError for combos it cannot run.

    "loop": rank r holds stages r, r+R, r+2R, ...; "v": rows of R stages alternate direction, so with two
    rows rank r holds r and 2R-1-r (consecutive stages R-1 and R share the last rank).
    """
    info = schedule_info(schedule)
    if num_ranks < 1 or num_stages < 1:
        raise ValueError(f"schedule {schedule!r}: need at least 1 rank and 1 stage; got {num_stages} "
                         f"stages on {num_ranks} ranks")
    if info.stage_counts == "one" and num_stages != num_ranks:
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank; got {num_stages} stages on {num_ranks} ranks: "
            f"use --schedule interleaved-1f1b or --stages {num_ranks}")
    if info.stage_counts == "two" and num_stages != 2 * num_ranks:
        raise ValueError(
            f"schedule {schedule!r} runs exactly 2 stages per rank (a V); got {num_stages} stages on "
            f"{num_ranks} ranks: use --stages {2 * num_ranks}")
    check_stages_divide(num_stages, num_ranks)
    if info.placement == "v":
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
    needed = schedule_info(schedule).microbatches_per_rank * num_ranks
    if num_stages > num_ranks and num_microbatches < needed:
        raise ValueError(
            f"schedule {schedule!r} needs at least as many microbatches as ranks; got {num_microbatches} "
            f"microbatches on {num_ranks} ranks: use --microbatches {needed} or more "
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

class _FillWeights:
    """Policy: keep the static F/I order per rank; run each I's W when the next static action would wait, or
    when more than ``w_limit`` W's are pending; flush the rest at the end."""

    timed = True

    def __init__(self, static: dict, w_limit: int):
        self.static, self.w_limit = static, w_limit
        self.index = {r: 0 for r in static}
        self.pending: dict = {r: [] for r in static}

    def done(self, r):
        return self.index[r] >= len(self.static[r]) and not self.pending[r]

    def next(self, replay, r):
        pending, left = self.pending[r], self.index[r] < len(self.static[r])
        if pending and (len(pending) > self.w_limit or not left):
            return pending[0]
        if left:
            a = self.static[r][self.index[r]]
            t = replay.ready_time(a)
            if t is not None and t <= replay.clock[r]:
                return a
            if pending:
                return pending[0]
            return Wait(t) if t is not None else None
        return None

    def taken(self, r, a):
        if a.kind == "W":
            self.pending[r].pop(0)
            return
        self.index[r] += 1
        if a.kind == "I":
            self.pending[r].append(Action(a.stage, "W", a.mb))


class _GreedyV:
    """Policy of the greedy V-placement schedule (see module doc)."""

    timed = True

    def __init__(self, stage_to_rank, num_microbatches, full_backward_until_cooldown, w_limit):
        self.stages = rank_stages(stage_to_rank)
        self.m = num_microbatches
        self.full_backward_until_cooldown, self.w_limit = full_backward_until_cooldown, w_limit
        self.next_f = {s: 0 for s in range(len(stage_to_rank))}
        self.next_b = {s: 0 for s in range(len(stage_to_rank))}
        self.pending: dict = {r: [] for r in self.stages}
        self.cap = 2 * len(self.stages)

    def _live(self, r):
        return sum(self.next_f[s] - self.next_b[s] for s in self.stages[r])

    def done(self, r):
        return all(self.next_b[s] >= self.m for s in self.stages[r]) and not self.pending[r]

    def next(self, replay, r):
        pending, m = self.pending[r], self.m
        if len(pending) > self.w_limit:
            return pending[0]
        f_left = any(self.next_f[s] < m for s in self.stages[r])
        cands = []
        for s in self.stages[r]:
            if self.next_b[s] < self.next_f[s]:  # backwards in microbatch order per stage
                kind = "B" if (self.full_backward_until_cooldown and f_left) else "I"
                cands.append((0, self.next_b[s], -s, Action(s, kind, self.next_b[s])))
        for rank_in_v, s in enumerate(sorted(self.stages[r], reverse=True)):
            if self.next_f[s] < m:
                if s == min(self.stages[r]) and self._live(r) >= self.cap:
                    continue
                cands.append((1 + rank_in_v, self.next_f[s], -s, Action(s, "F", self.next_f[s])))
        cands.sort()
        waits = []
        for *_, a in cands:
            t = replay.ready_time(a)
            if t is None:
                continue
            if t <= replay.clock[r]:
                return a
            waits.append(t)
        if pending:
            return pending[0]
        return Wait(min(waits)) if waits else None

    def taken(self, r, a):
        if a.kind == "W":
            self.pending[r].pop(0)
        elif a.kind == "F":
            self.next_f[a.stage] += 1
        else:
            self.next_b[a.stage] += 1
            if a.kind == "I":
                self.pending[r].append(Action(a.stage, "W", a.mb))


# the greedy pass of _fuse_free_splits replays the plan once per remaining pair: it runs while pairs x actions stays
# under this (a 4-rank, 8-stage plan of 32 microbatches: about 1e5), so planning stays well under a second
FUSE_REPLAY_BUDGET = 300_000


def _adjacent_splits(orders: dict) -> list:
    """``(rank, position)`` of every I followed at once by the W of its stage and microbatch."""
    return [(r, i) for r, actions in orders.items() for i, (a, b) in enumerate(zip(actions, actions[1:]))
            if a.kind == "I" and b.kind == "W" and (a.stage, a.mb) == (b.stage, b.mb)]


def _fused(actions: list, positions) -> list:
    """``actions`` with the I at each of ``positions`` and the W after it made one full backward B."""
    out, skip = [], set()
    for i, a in enumerate(actions):
        if i in skip:
            continue
        if i in positions:
            out.append(Action(a.stage, "B", a.mb))
            skip.add(i + 1)
        else:
            out.append(a)
    return out


def _fuse_free_splits(orders: dict, stage_to_rank, topology) -> dict:
    """Each I followed at once by its own W becomes one full backward B wherever the unit-cost replay's step stays as
    short as it was. Such a split only sends the input gradient a W earlier; where no rank's step ends sooner for it,
    it costs its runtime bookkeeping (finding the entry nodes of each microbatch's graph, a second pass over the
    weight gradients' inputs) and buys nothing.

    First every pair whose gradient's readers (the backward of each stage it goes back to, same microbatch) start
    no earlier than its W ends anyway: fusing those moves no action's start, all at once. Then, while the plan is
    small enough (:data:`FUSE_REPLAY_BUDGET`), each remaining pair in turn, kept fused where a replay of the whole
    plan ends no later (a reader that starts later but off the critical path)."""
    result = replay(orders, stage_to_rank, topology)
    when = {(a.stage, a.kind, a.mb): (start, end) for timeline in result.timeline.values()
            for _pos, a, start, end in timeline}
    never = (float("inf"), float("inf"))
    free: dict = {}
    for r, i in _adjacent_splits(orders):
        a = orders[r][i]
        w_end = when[(a.stage, "W", a.mb)][1]
        if all(min(when.get((p, "B", a.mb), never)[0], when.get((p, "I", a.mb), never)[0]) >= w_end
               for p in grad_producers(topology, a.stage)):
            free.setdefault(r, set()).add(i)
    current = {r: _fused(actions, free.get(r, ())) for r, actions in orders.items()}
    remaining = _adjacent_splits(current)
    if len(remaining) * sum(map(len, current.values())) > FUSE_REPLAY_BUDGET:
        return current
    base, shift = result.makespan, dict.fromkeys(current, 0)  # shift: pairs fused so far on a rank, before the next
    for r, i in sorted(remaining):
        trial = dict(current)
        trial[r] = _fused(current[r], {i - shift[r]})
        if replay(trial, stage_to_rank, topology).makespan <= base:
            current, shift[r] = trial, shift[r] + 1
    return current


def _drive(policy, stage_to_rank, topology) -> dict:
    """Per-rank orders: the engine replays with unit costs and asks ``policy`` what each free rank runs next."""
    return Replay(stage_to_rank, topology).run(policy).orders


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

def _orders(schedule: str, num_ranks: int, num_stages: int, m: int, stage_to_rank, topology,
            training: bool) -> dict:
    """The schedule's per-rank orders before :func:`_fuse_free_splits` (which :func:`generate` applies to the ones
    that split backwards)."""
    if schedule == "gpipe":
        out = _gpipe(num_ranks, m)
    elif schedule == "1f1b":
        out = _one_f_one_b(num_ranks, m)
    elif schedule == "interleaved-1f1b":
        out = _interleaved(num_ranks, num_stages, m)
    elif schedule == "looped-bfs":
        out = _looped_bfs(num_ranks, num_stages, m)
    elif schedule == "interleaved-zb":
        # w_limit=0: every W runs right after its I (see the module doc), so no more activations are alive at once
        # than in interleaved 1F1B; the split sends each input gradient a W earlier
        out = (_drive(_FillWeights(_interleaved(num_ranks, num_stages, m, bwd="I"), w_limit=0), stage_to_rank,
                      topology) if training else _interleaved(num_ranks, num_stages, m))
    elif schedule == "dualpipev" and m >= 2 * num_ranks:
        out = _dualpipev(num_ranks, m)
    else:  # zbv; dualpipev with fewer than 2p microbatches
        out = _drive(_GreedyV(stage_to_rank, m, full_backward_until_cooldown=(schedule == "dualpipev"),
                              w_limit=num_ranks), stage_to_rank, topology)
    return out


def generate(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int,
             training: bool = True, topology: Topology | None = None) -> dict[int, list[Action]]:
    """Per-rank compute-only action lists for ``schedule`` (see module doc).

    ``topology`` defaults to a chain; the static schedules do not depend on it, the timed ones
    (interleaved-zb, zbv, dualpipev) use it to see when inputs are ready.
    """
    stage_to_rank = placement(schedule, num_ranks, num_stages)
    _check_microbatches(schedule, num_ranks, num_stages, num_microbatches)
    topology = topology or Topology.chain(num_stages)
    out = _orders(schedule, num_ranks, num_stages, num_microbatches, stage_to_rank, topology, training)
    if training and SCHEDULE_TABLE[schedule].split_backward:
        # a split stays only where its earlier input gradient shortens the step (interleaved-zb: most of them
        # go; zbv, dualpipev: the few W's that land right after their own I)
        out = _fuse_free_splits(out, stage_to_rank, topology)
    if not training:
        out = {r: [a for a in acts if a.kind == "F"] for r, acts in out.items()}
    return {r: out.get(r, []) for r in range(num_ranks)}
