"""The one replay engine: run per-rank action lists under the runtime's execution model, and check them.

Everything tracepp knows about how a plan behaves comes from here. The schedulers build their orders by
driving the engine with a :class:`Policy` (a static list is the trivial policy, :class:`ListPolicy`); the
lowering times compute-only lists with it and keeps the receive placement that replays faster; the one
validator (:func:`check_plan` for the rules a list must follow, then a replay for deadlocks) refuses a bad
plan naming rank, position, action and the fix; ``codegen.simulate`` turns a replay into bubbles and
pictures; and the send-release points that a rank script lists in ``RELEASES`` are derived from the replay's
vector clocks (:attr:`ReplayResult.releases`).

Why it lives in the runtime: a rank whose script was edited validates the gathered plan at start-up with this
same engine (``script_check``), and the output folder runs where only torch is installed. So this module and
``actions`` use the standard library only; ``tracepp.codegen`` imports them from here (codegen may depend on
the runtime, never the reverse).

Execution model (what the tracepp runtime does, and what NCCL allows):

* Each rank walks its action list in order.
* A maximal run of consecutive comm actions is one *batch*, posted together (``batch_isend_irecv``).
  Posting never blocks.
* A rank's posted batches complete in FIFO order (one serial comm stream per rank): a batch reaches the *head*
  of its rank's queue when every earlier batch of that rank has completed.
* Point-to-point ops match per ordered rank pair in issue order (no tags): the n-th send from rank A to rank B
  pairs with the n-th receive on B from A. An op is matched once both its batch and its counterpart's batch
  are at the head of their queues; a batch completes when all its ops are matched.
* A compute action starts when its rank is free and its inputs are there: a value made on the same rank once
  its producer ended, a value from another rank once the batch holding its receive completed. Lists without
  comm actions (compute-only, before lowering) move data instantly: a value is there once its producer ends.
* Compute costs :data:`UNIT_COSTS` unless the caller gives its own (see :func:`cost_of`); comms cost 0 unless
  the caller gives a :class:`CommModel` (the planner's calibrated simulator does; the schedulers, the lowering,
  validation and the start-up check of edited scripts do not: unit costs, free comms).

A plan that runs under this model also runs under gloo, whose p2p ops are less constrained.

What a :class:`CommModel` adds (all times in the caller's unit, seconds when calibrated):

* a message's transfer time: ``delay + tensors x latency + bytes / bandwidth`` for its rank pair (one SEND/RECV
  action carries every tensor of that stage edge for one microbatch; the runtime posts one isend/irecv per
  tensor; ``delay``: a fixed time per message on top of the link's, e.g. the wake-up of a busy receiver). An
  op's transfer starts when it is *matched* (both its batch and its counterpart's batch at the head of their
  queues; with ``serial=False``, gloo's model, as soon as both ops are posted, with no per-rank queue) and its
  batch completes when every op's transfer has ended. Transfers of different rank pairs overlap;
* a fixed runtime overhead per compute action (``compute_overhead``, per kind or one number: Python dispatch,
  autograd set-up, what the executor does around the stage function) added to its cost, and per comm op posted
  (``op_overhead``: the rank is busy posting and later waiting on it) that moves the rank's clock.

What it does not model: contention between transfers sharing a link or a rank's copy engine, compute slowed
by concurrent transfers or by other processes on the same cores, the optimizer step and anything else outside
the action list (the caller adds those), memory-allocation stalls, and the variance of any of these.

Send release (``RELEASES``): gloo reports a send complete only when it is waited on, so a sent tensor lives
until the wait. A send may be waited on as soon as this rank *knows* that the peer posted the matching
receive: it has since received a message the peer sent after posting it. Vector clocks carry that knowledge:
each rank's clock counts the actions it has passed, a send carries its rank's clock, and a compute merges the
clocks of the sends whose data it waits for.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .actions import Action, Topology

# The costs a plan is made with (placing receives, deferred W's, the greedy V schedules) and timed with unless
# measured ones are given: a forward 1, a full backward 2, its input-grad and weight-grad halves 1 each.
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
# The cost kind of a W run right after the I of its own stage and microbatch (see :func:`cost_of`)
W_AFTER_I = "W_after_I"
# The dependency key "this stage's input gradient for a microbatch is done": made by a full backward B or by
# an input-grad backward I, needed by the W of the same stage and by the backward of the stage before.
INPUT_GRAD = "input-grad"


class ScheduleError(ValueError):
    """A plan breaks a rule or would deadlock. ``rank``/``position``/``action`` locate it where one action is at
    fault (``position`` is None when the fix is to add something to ``rank``'s list); the message says what is
    wrong and the fix, prefixed ``rank R, action P 'A': `` when located."""

    def __init__(self, problem: str, rank: Optional[int] = None, position: Optional[int] = None, action=None):
        self.problem, self.rank, self.position, self.action = problem, rank, position, action
        located = rank is not None and position is not None and action is not None
        super().__init__(f"rank {rank}, action {position} '{action}': {problem}" if located else problem)

    def prefixed(self, prefix: str) -> "ScheduleError":
        """The same error, its message prefixed (e.g. with the CSV's path)."""
        error = ScheduleError(f"{prefix}{self}")
        error.problem, error.rank, error.position, error.action = self.problem, self.rank, self.position, self.action
        return error


# ----------------------------------------------------------------------------------------------------
# what depends on what

_ADJACENCY: dict = {}  # id(topology) -> (topology, tables): topologies are tuples, slow to hash per call


def _adjacency(topology: Topology) -> dict:
    cached = _ADJACENCY.get(id(topology))
    if cached is not None and cached[0] is topology:
        return cached[1]
    table = {"producers": {}, "consumers": {}, "grad_consumers": {}, "grad_producers": {}}
    for i, j in topology.fwd_edges:
        table["producers"].setdefault(j, set()).add(i)
        table["consumers"].setdefault(i, set()).add(j)
    for i, j in topology.grad_edges:
        table["grad_consumers"].setdefault(i, set()).add(j)
        table["grad_producers"].setdefault(j, set()).add(i)
    tables = {name: {s: sorted(v) for s, v in by_stage.items()} for name, by_stage in table.items()}
    if len(_ADJACENCY) > 64:
        _ADJACENCY.clear()
    _ADJACENCY[id(topology)] = (topology, tables)
    return tables


def _neighbours(topology: Topology, name: str, stage: int) -> list:
    return _adjacency(topology)[name].get(stage, [])


def producers(topology: Topology, stage: int) -> list:
    """Stages whose activations ``stage`` consumes (forward edges into it), sorted."""
    return _neighbours(topology, "producers", stage)


def consumers(topology: Topology, stage: int) -> list:
    """Stages that consume ``stage``'s activations (forward edges out of it), sorted."""
    return _neighbours(topology, "consumers", stage)


def grad_consumers(topology: Topology, stage: int) -> list:
    """Stages that send a gradient back to ``stage`` (grad edges out of it), sorted."""
    return _neighbours(topology, "grad_consumers", stage)


def grad_producers(topology: Topology, stage: int) -> list:
    """Stages to which ``stage`` sends a gradient (grad edges into it), sorted."""
    return _neighbours(topology, "grad_producers", stage)


def compute_deps(action: Action, topology: Topology) -> list:
    """Keys a compute action needs: ``(stage, 'F', mb)`` forward done, ``(stage, INPUT_GRAD, mb)`` input grad
    done (by a full backward ``B`` or an input-grad backward ``I``)."""
    stage, kind, mb = action.stage, action.kind, action.mb
    if kind == "F":
        return [(i, "F", mb) for i in producers(topology, stage)]
    if kind in ("B", "I"):
        return [(stage, "F", mb)] + [(j, INPUT_GRAD, mb) for j in grad_consumers(topology, stage)]
    if kind == "W":
        return [(stage, INPUT_GRAD, mb)]
    raise ValueError(f"not a compute action: {action}")


def produced_key(action: Action) -> tuple:
    """The dependency key a compute action produces (W produces one nothing waits on)."""
    kind = "F" if action.kind == "F" else INPUT_GRAD if action.kind in ("B", "I") else "W"
    return (action.stage, kind, action.mb)


def recv_for(dep_key: tuple, consumer_stage: int) -> Action:
    """The receive that carries ``dep_key`` from another rank into ``consumer_stage``."""
    stage, what, mb = dep_key
    return Action(consumer_stage, "RECV_F" if what == "F" else "RECV_B", mb, peer=stage)


def counterpart(action: Action) -> Action:
    """The receive of a send, or the send of a receive."""
    kind = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[action.kind]
    return Action(action.peer, kind, action.mb, action.stage)


def _key_text(key: tuple) -> str:
    stage, what, mb = key
    return f"'{stage}F{mb}'" if what == "F" else f"'{stage}B{mb}' or '{stage}I{mb}'"


def cost_of(action: Action, costs=None, after_own_input: bool = False) -> float:
    """Cost of a compute action: ``costs`` maps kind -> time and/or (stage, kind) -> time (a stage's own entry
    wins; a B priced by neither costs its I + W); anything unpriced costs :data:`UNIT_COSTS`.
    ``after_own_input``: the action is a W that its rank runs right after the I of the same stage and
    microbatch (no compute between): priced as :data:`W_AFTER_I` where ``costs`` has that kind (its data is
    still in cache; a W deferred past other work is not), else as any W."""
    if costs:
        if after_own_input:
            if (action.stage, W_AFTER_I) in costs:
                return float(costs[(action.stage, W_AFTER_I)])
            if W_AFTER_I in costs:
                return float(costs[W_AFTER_I])
        if (action.stage, action.kind) in costs:
            return float(costs[(action.stage, action.kind)])
        if action.kind in costs:
            return float(costs[action.kind])
        if action.kind == "B":  # a full backward costs what its two halves do
            i = costs.get((action.stage, "I"), costs.get("I"))
            w = costs.get((action.stage, "W"), costs.get("W"))
            if i is not None and w is not None:
                return float(i) + float(w)
    return UNIT_COSTS[action.kind]


class CommModel:
    """Message transfer times and per-action runtime overheads for a timed replay (see the module doc).

    ``links``: ``{(rank_a, rank_b): (latency, bandwidth)}`` per rank pair, either order; ``default``: the
    ``(latency, bandwidth)`` of a pair not listed (bandwidth ``None`` or 0: bytes are free). ``messages``:
    ``{(producer stage, consumer stage, "F" or "B"): (tensors, bytes)}``: what one SEND/RECV action of that
    edge carries for one microbatch (activations "F", gradients "B"); an edge not listed carries one tensor of
    0 bytes. ``message_delay``: added to every message's transfer (idle time of the ranks that wait for it, which
    other work may fill). ``compute_overhead``: added to every compute action's cost, a number or ``{kind: number}``.
    ``op_overhead``: rank time per comm op posted. ``serial``: True (default): a rank's comm batches complete in
    FIFO order (NCCL's stream); False: ops are independent (gloo's isend/irecv).
    """

    def __init__(self, links=None, default=(0.0, None), messages=None, compute_overhead=0.0, op_overhead=0.0,
                 serial=True, message_delay=0.0):
        self.links = {}
        for (a, b), link in (links or {}).items():
            self.links[(a, b)] = self.links[(b, a)] = (float(link[0]), link[1])
        self.default = (float(default[0]), default[1])
        self.messages = dict(messages or {})
        self.compute_overhead = compute_overhead
        self.op_overhead = float(op_overhead)
        self.serial = bool(serial)
        self.message_delay = float(message_delay)

    def message(self, op: Action) -> tuple:
        """(tensors, bytes) that the comm action ``op`` moves."""
        if op.kind in ("SEND_F", "RECV_B"):  # at the producer stage
            producer, consumer = op.stage, op.peer
        else:  # RECV_F, SEND_B: at the consumer stage
            producer, consumer = op.peer, op.stage
        direction = "F" if op.kind.endswith("F") else "B"
        return self.messages.get((producer, consumer, direction), (1, 0))

    def transfer(self, op: Action, rank: int, peer_rank: int) -> float:
        """Seconds (or units) from the match of ``op`` to the end of its transfer between the two ranks."""
        latency, bandwidth = self.links.get((rank, peer_rank), self.default)
        tensors, size = self.message(op)
        return self.message_delay + tensors * latency + (size / bandwidth if bandwidth else 0.0)

    def overhead(self, kind: str) -> float:
        extra = self.compute_overhead
        if isinstance(extra, dict):
            return float(extra.get(kind, 0.0))
        return float(extra)


# ----------------------------------------------------------------------------------------------------
# policies: what a rank runs next

class Wait(NamedTuple):
    """A policy's answer "nothing to run before ``until``": the rank's clock moves there."""
    until: float


class ListPolicy:
    """The trivial policy: every rank runs its given list in order (a run of comm actions is one batch).

    A policy answers ``next(replay, rank)`` with an Action, a list of comm actions (one batch), a :class:`Wait`,
    or None (nothing now); ``taken(rank, choice)`` after the engine ran it; ``done(rank)``. ``timed``: False
    lets the engine run each rank as far as it can (times do not depend on the order ranks are served); True
    serves the rank with the earliest clock first, one action at a time, so a policy deciding at time t has
    seen everything that ends by t (the list schedulers).
    """

    timed = False

    def __init__(self, lists: dict):
        self.items = {}
        for rank, actions in lists.items():
            items, batch = [], None
            for action in actions:
                if action.is_comm:
                    if batch is None:
                        batch = []
                        items.append(batch)
                    batch.append(action)
                else:
                    batch = None
                    items.append(action)
            self.items[rank] = items
        self.index = {rank: 0 for rank in lists}
        self.has_comm = any(a.is_comm for actions in lists.values() for a in actions)

    def done(self, rank: int) -> bool:
        return self.index.get(rank, 0) >= len(self.items.get(rank, ()))

    def next(self, replay, rank: int):
        return self.items[rank][self.index[rank]]

    def taken(self, rank: int, choice) -> None:
        self.index[rank] += 1


# ----------------------------------------------------------------------------------------------------
# the engine

@dataclass
class CommBatch:
    """A run of consecutive comm actions of one rank, posted together; times under the execution model."""
    rank: int
    positions: list
    ops: list
    posted: float = 0.0
    head: Optional[float] = None  # when it reached the head of its rank's queue
    done: Optional[float] = None


@dataclass
class ReplayResult:
    """What a replay found. ``orders[rank]``: the actions run, in order (for a static list, the list itself).
    ``timeline[rank]``: ``(position, action, start, end)`` per compute action. ``batches[rank]``: its
    :class:`CommBatch` es. ``releases[rank]``: ``{position: [positions of earlier sends]}``: after the action at
    ``position`` those sends' receives are provably posted (what a rank script's ``RELEASES`` holds).
    ``first_release[rank]``: send position -> the earliest such position (a later one is as safe)."""
    orders: dict
    timeline: dict
    batches: dict
    releases: dict
    first_release: dict
    makespan: float = 0.0
    costs: dict = field(default_factory=dict)
    ends: dict = field(default_factory=dict)  # rank -> when its step is over (its last compute or comm op)


class Replay:
    """One replay of a plan: per-rank clocks, values made, comm queues and vector clocks, driven by a policy.
    ``comm``: a :class:`CommModel` (transfer times, overheads), or None: comms free, no overheads."""

    def __init__(self, stage_to_rank: list, topology: Topology, costs=None, ranks=(), comm: "CommModel" = None):
        self.stage_to_rank = list(stage_to_rank)
        self.topology = topology
        self.costs = costs
        self.model = comm
        self.op_done: dict = {}  # (rank, position) -> when that comm op's transfer ended (with a CommModel)
        self.ranks = sorted(set(self.stage_to_rank) | set(ranks))
        self.clock = {r: 0.0 for r in self.ranks}
        self.position = {r: 0 for r in self.ranks}
        self.ready: dict = {}  # dependency key -> time it was made
        self.orders = {r: [] for r in self.ranks}
        self.last_compute = {r: None for r in self.ranks}  # each rank's last compute action (see cost_of)
        self.timeline = {r: [] for r in self.ranks}
        self.batches = {r: [] for r in self.ranks}
        self.waiting: dict = {}  # rank -> what its next action waits for (deadlock report)
        self.comm = False
        # comm state: FIFO queues, and per ordered rank pair the sends and receives in issue order
        self.queue = {r: [] for r in self.ranks}
        self.last_done = {r: 0.0 for r in self.ranks}
        self.sends: dict = {}  # (src rank, dst rank) -> [(position, action, batch)]
        self.recvs: dict = {}  # (src rank, dst rank) -> [(position, action, batch)]
        self.slot: dict = {}  # (rank, position) -> (channel, is_send, index in the channel)
        self.posted_recv = {r: {} for r in self.ranks}  # rank -> recv action -> (position, batch)
        # vector clocks and send release
        self.vclock = {r: {q: 0 for q in self.ranks} for r in self.ranks}
        self.send_clock: dict = {}  # (rank, position) -> the sender's clock when it posted the send
        self.unreleased = {r: {} for r in self.ranks}  # peer rank -> deque of (send position, index in channel)
        self.releases = {r: {} for r in self.ranks}
        self._needs: dict = {}  # action -> [(dependency key, the receive carrying it or None if made locally)]

    def _deps(self, action: Action) -> list:
        needs = self._needs.get(action)
        if needs is None:
            home = self.stage_to_rank[action.stage]
            needs = [(dep, recv_for(dep, action.stage) if self.comm and self.stage_to_rank[dep[0]] != home else None)
                     for dep in compute_deps(action, self.topology)]
            self._needs[action] = needs
        return needs

    # -- what a policy may ask -------------------------------------------------------------------------
    def ready_time(self, action: Action) -> Optional[float]:
        """When the values ``action`` needs are all made (compute-only replays), or None if one is not yet."""
        t = 0.0
        for dep, _recv in self._deps(action):
            made = self.ready.get(dep)
            if made is None:
                return None
            t = max(t, made)
        return t

    # -- running -----------------------------------------------------------------------------------------
    def run(self, policy) -> ReplayResult:
        """Replay until every rank is done; raise :class:`ScheduleError` naming each stuck rank on deadlock."""
        self.comm = getattr(policy, "has_comm", False)
        timed = getattr(policy, "timed", False)
        progress = True
        while progress:
            progress = False
            order = sorted(self.ranks, key=lambda r: (self.clock[r], r)) if timed else self.ranks
            for rank in order:
                moved = False
                while not policy.done(rank):
                    choice = policy.next(self, rank)
                    if choice is None:
                        break
                    if isinstance(choice, Wait):
                        if choice.until <= self.clock[rank]:
                            break
                        self.clock[rank] = choice.until
                    elif isinstance(choice, list):
                        self._post(rank, choice)
                        policy.taken(rank, choice)
                    elif self._compute(rank, choice):
                        policy.taken(rank, choice)
                    else:
                        break
                    moved = True
                    if timed:
                        break
                if moved:
                    progress = True
                    if timed:
                        break
            if self.comm and self._match():
                progress = True
        stuck = [r for r in self.ranks if not policy.done(r) or self.queue[r]]
        if stuck:
            self._deadlock(policy, stuck)
        makespan = max([end for entries in self.timeline.values() for *_, end in entries] + [0.0])
        ends = {}
        for r in self.ranks:  # the runtime waits on every send at the end of the step
            ends[r] = max([self.clock[r]] + [b.done for b in self.batches[r] if b.done is not None])
        if self.model is not None:
            makespan = max([makespan] + list(ends.values()))
        first = {r: {p: at for at, sends in self.releases[r].items() for p in sends} for r in self.ranks}
        used = dict(UNIT_COSTS)
        used.update(self.costs or {})
        return ReplayResult(self.orders, self.timeline, self.batches, self.releases, first, makespan, used, ends)

    def _compute(self, rank: int, action: Action) -> bool:
        """Run ``action`` on ``rank`` if its inputs are there; False (and why, in ``waiting``) if not."""
        start, merges = self.clock[rank], []
        for dep, recv in self._deps(action):
            if recv is not None:
                posted = self.posted_recv[rank].get(recv)
                arrived = None if posted is None else self._arrived(rank, posted)
                if arrived is None:
                    self.waiting[rank] = f"for '{recv}'"
                    return False
                start = max(start, arrived)
                merges.append(self._partner(rank, posted[0]))
            else:
                made = self.ready.get(dep)
                if made is None:
                    where = self.stage_to_rank[dep[0]] if 0 <= dep[0] < len(self.stage_to_rank) else None
                    self.waiting[rank] = f"for {_key_text(dep)}" + (f" on rank {where}" if where != rank else "")
                    return False
                start = max(start, made)
        self.waiting.pop(rank, None)
        previous = self.last_compute[rank]
        after_own_input = (action.kind == "W" and previous is not None and previous.kind == "I"
                           and previous.stage == action.stage and previous.mb == action.mb)
        end = start + cost_of(action, self.costs, after_own_input)
        self.last_compute[rank] = action
        if self.model is not None:
            end += self.model.overhead(action.kind)
        position = self.position[rank]
        self.ready[produced_key(action)] = end
        self.timeline[rank].append((position, action, start, end))
        self.orders[rank].append(action)
        self.clock[rank] = end
        self.position[rank] += 1
        clock = self.vclock[rank]
        clock[rank] = position + 1
        for send in merges:
            for q, value in self.send_clock[(send[0], send[1])].items():
                if value > clock[q]:
                    clock[q] = value
        self._release(rank, position)
        return True

    def _arrived(self, rank: int, posted: tuple):
        """When the receive posted at ``posted`` = (position, batch) has its data, or None if not yet: its batch's
        completion (FIFO), or with a non-serial CommModel its own transfer's end."""
        if self.model is not None and not self.model.serial:
            return self.op_done.get((rank, posted[0]))
        return posted[1].done

    def _post(self, rank: int, ops: list) -> None:
        if self.model is not None and self.model.op_overhead:
            self.clock[rank] += self.model.op_overhead * len(ops)
        batch = CommBatch(rank, [], list(ops), posted=self.clock[rank])
        for op in ops:
            position = self.position[rank]
            if op.peer is None or not 0 <= op.peer < len(self.stage_to_rank):
                raise ScheduleError("comm action without a valid peer stage; write the peer, e.g. '0SEND_F1>1'",
                                    rank, position, op)
            peer = self.stage_to_rank[op.peer]
            is_send = op.kind.startswith("SEND")
            channel = (rank, peer) if is_send else (peer, rank)
            entries = (self.sends if is_send else self.recvs).setdefault(channel, [])
            self.slot[(rank, position)] = (channel, is_send, len(entries))
            entries.append((position, op, batch))
            batch.positions.append(position)
            self.orders[rank].append(op)
            self.position[rank] += 1
            self.vclock[rank][rank] = position + 1
            if is_send:
                self.send_clock[(rank, position)] = dict(self.vclock[rank])
                self.unreleased[rank].setdefault(peer, collections.deque()).append((position, len(entries) - 1))
            else:
                self.posted_recv[rank][op] = (position, batch)
            self._release(rank, position)
        self.batches[rank].append(batch)
        if self.model is not None and not self.model.serial:
            self._match_posted(rank, batch)
            return
        self.queue[rank].append(batch)
        self._set_head(rank)

    def _match_posted(self, rank: int, batch: CommBatch) -> None:
        """Non-serial comms: each op of a new batch whose counterpart is posted transfers from the later post."""
        for position, op in zip(batch.positions, batch.ops):
            partner = self._partner(rank, position)
            if partner is None:
                continue
            peer, peer_position, peer_batch = partner
            done = max(batch.posted, peer_batch.posted) + self.model.transfer(op, rank, peer)
            self.op_done[(rank, position)] = self.op_done[(peer, peer_position)] = done
            for owner, owner_batch in ((rank, batch), (peer, peer_batch)):
                times = [self.op_done.get((owner, p)) for p in owner_batch.positions]
                if all(t is not None for t in times):
                    owner_batch.head = owner_batch.posted
                    owner_batch.done = max(times)

    def _partner(self, rank: int, position: int):
        """(rank, position, batch) of the op matched with this rank's comm op at ``position``, or None."""
        channel, is_send, index = self.slot[(rank, position)]
        others = (self.recvs if is_send else self.sends).get(channel, [])
        if index >= len(others):
            return None
        other_position, _op, batch = others[index]
        return (channel[1] if is_send else channel[0], other_position, batch)

    def _release(self, rank: int, position: int) -> None:
        """Sends of ``rank`` before ``position`` whose receive ``rank`` now knows posted: released after it.
        Per peer, receives are posted in the order of the sends, so what is released is a prefix."""
        clock, released = self.vclock[rank], []
        for peer, pending in self.unreleased[rank].items():
            recvs = self.recvs.get((rank, peer), ())
            while pending:
                send_position, index = pending[0]
                if send_position >= position or index >= len(recvs) or clock[peer] <= recvs[index][0]:
                    break
                released.append(send_position)
                pending.popleft()
        if released:
            self.releases[rank].setdefault(position, []).extend(sorted(released))

    def _set_head(self, rank: int) -> None:
        if self.queue[rank]:
            batch = self.queue[rank][0]
            if batch.head is None:
                batch.head = max(batch.posted, self.last_done[rank])

    def _match(self) -> bool:
        """Complete every head batch whose ops' counterparts are at their heads too, to a fixpoint."""
        any_done, changed = False, True
        while changed:
            changed = False
            for rank in self.ranks:
                if not self.queue[rank]:
                    continue
                batch = self.queue[rank][0]
                t = batch.head
                for position, op in zip(batch.positions, batch.ops):
                    partner = self._partner(rank, position)
                    if partner is None or partner[2].head is None:
                        break
                    if self.model is None:
                        t = max(t, partner[2].head)
                    else:  # the op's transfer starts at its match
                        t = max(t, max(batch.head, partner[2].head) + self.model.transfer(op, rank, partner[0]))
                else:
                    batch.done = self.last_done[rank] = t
                    self.queue[rank].pop(0)
                    self._set_head(rank)
                    changed = any_done = True
        return any_done

    def _deadlock(self, policy, stuck: list) -> None:
        parts, first = [], None
        for rank in stuck:
            if self.queue[rank]:
                batch = self.queue[rank][0]
                for position, op in zip(batch.positions, batch.ops):
                    partner = self._partner(rank, position)
                    if partner is None or partner[2].head is None:
                        break
                peer = self.stage_to_rank[op.peer]
                other = counterpart(op) if partner is None else partner[2].ops[partner[2].positions.index(partner[1])]
                parts.append(f"rank {rank} waits at action {position} '{op}' (rank {peer} has not reached '{other}')")
                first = first or (rank, position, op)
            else:
                choice = policy.next(self, rank)
                position = self.position[rank]
                shown = choice[0] if isinstance(choice, list) else choice
                if isinstance(shown, Action):
                    why = self.waiting.get(rank, "for nothing it can run")
                    parts.append(f"rank {rank} waits at action {position} '{shown}' ({why})")
                    first = first or (rank, position, shown)
                else:
                    parts.append(f"rank {rank} stalls after action {position - 1}: nothing it may run next is ready")
        fix = ("each rank's comm actions complete in list order and a rank pair's sends and receives match in "
               "issue order, so order them as the peers reach them" if self.comm else
               "reorder the compute actions so that what each rank waits for runs first somewhere")
        message = "deadlock: " + ", ".join(parts) + f"; {fix}"
        error = ScheduleError(message)
        if first is not None:
            error.rank, error.position, error.action = first
        raise error


def replay(lists: dict, stage_to_rank: list, topology: Topology, costs=None, comm: CommModel = None) -> ReplayResult:
    """Replay static per-rank lists (compute-only or lowered) under the execution model; raise on deadlock.
    ``comm``: a :class:`CommModel` for transfer times and overheads (default: comms free)."""
    return Replay(stage_to_rank, topology, costs, ranks=lists, comm=comm).run(ListPolicy(lists))


# ----------------------------------------------------------------------------------------------------
# the validator

def check_plan(lists: dict, stage_to_rank: list, topology: Topology, num_microbatches: int,
               training: bool = True) -> None:
    """The rules a plan's lists must follow, checked rank by rank, position by position, so the error names the
    first bad action and its fix: every action on its stage's rank, microbatches in range, each (stage,
    microbatch) with exactly one F and (training) one backward, B or I + W; what an action needs made earlier on
    its rank. A *lowered* plan (any comm action) also needs every value that crosses ranks sent after it is made
    and received before it is used, one send and one receive per value, in the same order per rank pair.
    Compute-only lists (a user's CSV before lowering) move data between ranks in memory: those rules do not
    apply. Whether the plan deadlocks is the replay's to say (:func:`validate` does both).
    """
    num_stages = len(stage_to_rank)
    if topology.num_stages != num_stages:
        raise ScheduleError(f"stage_to_rank has {num_stages} stages but the topology has {topology.num_stages}")
    lowered = any(a.is_comm for actions in lists.values() for a in actions)
    fwd_edges, grad_edges = set(map(tuple, topology.fwd_edges)), set(map(tuple, topology.grad_edges))
    seen: dict = {}  # produced key -> (rank, position)
    comm_seen: dict = {}  # comm action -> (rank, position)
    for rank in sorted(lists):
        actions = lists[rank]
        done: set = set()  # keys made on this rank so far, and comm actions posted
        for position, a in enumerate(actions):
            def fail(problem, a=a, position=position, rank=rank):
                raise ScheduleError(problem, rank, position, a)

            if not 0 <= a.stage < num_stages:
                fail(f"stage {a.stage} does not exist (the plan has stages 0..{num_stages - 1})")
            home = stage_to_rank[a.stage]
            if home != rank:
                fail(f"stage {a.stage} lives on rank {home}, not rank {rank}; move the action to rank {home}")
            if not 0 <= a.mb < num_microbatches:
                fail(f"microbatch {a.mb} out of range ({num_microbatches} microbatches: 0..{num_microbatches - 1}); "
                     f"check --microbatches")
            if not training and a.kind not in ("F", "SEND_F", "RECV_F"):
                fail("the model has no loss_fn (forward only), so the plan may hold only forwards and their "
                     "activations (F, SEND_F, RECV_F)")
            if a.is_comm:
                _check_comm(a, rank, position, stage_to_rank, fwd_edges, grad_edges, done, comm_seen, fail)
                continue
            key = produced_key(a)
            if key in seen:
                r0, p0 = seen[key]
                name = "backward (B or I)" if key[1] == INPUT_GRAD else a.kind
                fail(f"duplicate {name} of stage {a.stage} microbatch {a.mb} (first at rank {r0}, action {p0} "
                     f"'{lists[r0][p0]}'); remove one of them")
            if a.kind == "W":
                g = seen.get((a.stage, INPUT_GRAD, a.mb))
                if g is None or g[0] != rank:
                    fail(f"weight-grad W before the input-grad '{a.stage}I{a.mb}'; put '{a.stage}I{a.mb}' earlier "
                         f"on rank {rank}")
                if lists[g[0]][g[1]].kind == "B":
                    fail(f"stage {a.stage} microbatch {a.mb} already has a full backward '{lists[g[0]][g[1]]}' "
                         f"(rank {g[0]}, action {g[1]}); use I + W or B")
            for dep in compute_deps(a, topology):
                if stage_to_rank[dep[0]] == rank:
                    if dep not in done:
                        kinds = ("F",) if dep[1] == "F" else ("B", "I")
                        wanted = [Action(dep[0], k, dep[2]) for k in kinds]
                        later = next((p for p in range(position + 1, len(actions)) if actions[p] in wanted), None)
                        if later is not None:
                            fail(f"needs '{actions[later]}' (action {later}) to run first; move it before action "
                                 f"{position}")
                        need = " or ".join(f"'{w}'" for w in wanted)
                        fail(f"needs {need} first, which rank {rank} never runs; add it before action {position}")
                elif lowered:
                    recv = recv_for(dep, a.stage)
                    if recv not in done:
                        what = "input" if dep[1] == "F" else "gradient"
                        later = next((p for p in range(position + 1, len(actions)) if actions[p] == recv), None)
                        fix = (f"move it (action {later}) before action {position}" if later is not None else
                               f"add it before action {position}, and '{counterpart(recv)}' on rank "
                               f"{stage_to_rank[dep[0]]}")
                        fail(f"its {what} from stage {dep[0]} ({recv.kind} '{recv}') has not arrived; {fix}")
            seen[key] = (rank, position)
            done.add(key)
    _check_complete(lists, stage_to_rank, num_microbatches, training, seen)
    if lowered:
        _check_pairs(lists, stage_to_rank, num_microbatches, training, fwd_edges, grad_edges, comm_seen)


def _check_comm(a, rank, position, stage_to_rank, fwd_edges, grad_edges, done, comm_seen, fail) -> None:
    if a.peer is None:
        fail("comm action without a peer stage; write it, e.g. '0SEND_F1>1'")
    if not 0 <= a.peer < len(stage_to_rank):
        fail(f"peer stage {a.peer} does not exist (the plan has stages 0..{len(stage_to_rank) - 1})")
    edge = {"SEND_F": (a.stage, a.peer), "RECV_F": (a.peer, a.stage),
            "SEND_B": (a.peer, a.stage), "RECV_B": (a.stage, a.peer)}[a.kind]
    forward = a.kind.endswith("F")
    if edge not in (fwd_edges if forward else grad_edges):
        what = "activation" if forward else "gradient"
        fail(f"there is no {what} edge {edge} in the topology (stage {edge[0]} does not feed stage {edge[1]}"
             f"{'' if forward else ' a value that carries a gradient'}); remove it")
    if stage_to_rank[a.peer] == rank:
        fail(f"stages {a.stage} and {a.peer} share rank {rank}; they pass values in memory, not by send/recv: "
             f"remove it")
    if a in comm_seen:
        r0, p0 = comm_seen[a]
        fail(f"duplicate of rank {r0}, action {p0}; remove one of them")
    comm_seen[a] = (rank, position)
    if a.kind == "SEND_F" and (a.stage, "F", a.mb) not in done:
        fail(f"sends activations before '{a.stage}F{a.mb}' has run; move it after '{a.stage}F{a.mb}'")
    if a.kind == "SEND_B" and (a.stage, INPUT_GRAD, a.mb) not in done:
        fail(f"sends a gradient before the backward (B or I) of stage {a.stage} microbatch {a.mb} has run; move it "
             f"after '{a.stage}B{a.mb}' (or '{a.stage}I{a.mb}')")
    done.add(a)


def _check_complete(lists, stage_to_rank, num_microbatches, training, seen) -> None:
    for stage, rank in enumerate(stage_to_rank):
        for mb in range(num_microbatches):
            if (stage, "F", mb) not in seen:
                raise ScheduleError(f"stage {stage} microbatch {mb} has no forward: add '{stage}F{mb}' to rank {rank}",
                                    rank)
            if not training:
                continue
            g = seen.get((stage, INPUT_GRAD, mb))
            if g is None:
                raise ScheduleError(f"stage {stage} microbatch {mb} has no backward: add '{stage}B{mb}' (or "
                                    f"'{stage}I{mb}' and '{stage}W{mb}') to rank {rank}", rank)
            backward = lists[g[0]][g[1]]
            if backward.kind == "I" and (stage, "W", mb) not in seen:
                raise ScheduleError(f"input-grad without its weight-grad: add '{stage}W{mb}' after it", g[0], g[1],
                                    backward)


def _check_pairs(lists, stage_to_rank, num_microbatches, training, fwd_edges, grad_edges, comm_seen) -> None:
    """Every value crossing ranks has one send and one receive, listed in the same order on both ranks."""
    expected = []
    for i, j in sorted(fwd_edges):
        if stage_to_rank[i] != stage_to_rank[j]:
            expected += [(Action(i, "SEND_F", m, j), Action(j, "RECV_F", m, i)) for m in range(num_microbatches)]
    if training:
        for i, j in sorted(grad_edges):
            if stage_to_rank[i] != stage_to_rank[j]:
                expected += [(Action(j, "SEND_B", m, i), Action(i, "RECV_B", m, j)) for m in range(num_microbatches)]
    for send, recv in expected:
        has_send, has_recv = send in comm_seen, recv in comm_seen
        if has_send and not has_recv:
            rank, position = comm_seen[send]
            raise ScheduleError(f"no matching '{recv}' on rank {stage_to_rank[recv.stage]}; add it there or remove "
                                f"this send", rank, position, send)
        if has_recv and not has_send:
            rank, position = comm_seen[recv]
            raise ScheduleError(f"no matching '{send}' on rank {stage_to_rank[send.stage]}; add it there or remove "
                                f"this receive", rank, position, recv)
        if not has_send:
            raise ScheduleError(f"missing '{send}' on rank {stage_to_rank[send.stage]} and '{recv}' on rank "
                                f"{stage_to_rank[recv.stage]}: add both", stage_to_rank[send.stage])
    channels: dict = {}  # (src rank, dst rank) -> ([(position, send)], [(position, recv)])
    for rank in sorted(lists):
        for position, a in enumerate(lists[rank]):
            if a.is_comm:
                peer = stage_to_rank[a.peer]
                if a.kind.startswith("SEND"):
                    channels.setdefault((rank, peer), ([], []))[0].append((position, a))
                else:
                    channels.setdefault((peer, rank), ([], []))[1].append((position, a))
    for (src, dst), (sends, recvs) in sorted(channels.items()):
        for n, ((sp, s), (rp, r)) in enumerate(zip(sends, recvs)):
            if counterpart(s) != r:
                raise ScheduleError(
                    f"rank pair {src}->{dst}: send #{n} on rank {src} is '{s}' (action {sp}) but receive #{n} on rank "
                    f"{dst} is '{r}' (action {rp}); NCCL matches sends and receives in issue order, so both ranks "
                    f"must list them in the same order", dst, rp, r)


def validate(lists: dict, stage_to_rank: list, topology: Topology, num_microbatches: int,
             training: bool = True, costs=None, comm: CommModel = None) -> ReplayResult:
    """The one validator: :func:`check_plan`, then a replay (deadlocks). Returns the replay (times, releases);
    with ``comm`` the replay is timed with it (a serial one sees the same deadlocks as none; a non-serial one
    cannot see those of NCCL's FIFO streams: validate without it first)."""
    lists = {rank: list(actions) for rank, actions in lists.items()}
    for rank in set(stage_to_rank):
        lists.setdefault(rank, [])
    check_plan(lists, list(stage_to_rank), topology, num_microbatches, training)
    return replay(lists, list(stage_to_rank), topology, costs, comm)
