"""Step 3, plan: stages to ranks, the schedule's per-rank action lists, comms inserted, validated once.

One entry point, :func:`build_plan`: a schedule name (``schedules.SCHEDULE_TABLE``) or a user CSV, the ranks,
stages and microbatches, and the data flow between stages (a ``Topology``; :func:`topology_of` reads it off a
PipelineGraph) give a :class:`SchedulePlan`: plain data, JSON-able for the manifest. The steps:

1. stage -> rank (the schedule's placement, or the CSV's rows) and the compute-only lists (the schedule's
   generator, or the CSV as written);
2. the one validator's rules (``runtime.replay.check_plan``) on what came in: a CSV's mistakes are named there;
3. lowering (``lower.lower_and_replay``): comm actions inserted, each receive placement replayed once by the
   engine, the faster kept;
4. the chosen plan checked against the same rules (lowered input: already done in 2); its replay (no
   deadlock) gives the send-release points each rank script lists in ``RELEASES``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tracepp.runtime.actions import Action, Topology
from tracepp.runtime.replay import UNIT_COSTS, ScheduleError, check_plan

from .csvio import load_csv, resolve_peers
from .lower import lower_and_replay
from .schedules import check_stages_divide, generate, is_csv, placement, placement_style


@dataclass
class SchedulePlan:
    """A complete pipeline plan: per-rank action lists with comm actions, validated.

    ``placement`` is "loop", "v" or "csv" (stage -> rank map taken from a user CSV). ``releases[rank]``:
    ``{position: [send positions]}`` (see ``runtime.replay``). ``recv_placement``: how the lowering placed
    receives ("timed", "early", or "as given" in a lowered CSV); ``costs``: the costs it used for that and for
    the timed schedules' decisions.
    """

    schedule: str
    placement: str
    stage_to_rank: list
    num_microbatches: int
    actions: dict = field(default_factory=dict)  # rank -> list[Action]
    training: bool = True
    releases: dict = field(default_factory=dict)  # rank -> {position: [send positions]}
    recv_placement: str = "as given"
    costs: dict = field(default_factory=lambda: dict(UNIT_COSTS))

    @property
    def num_ranks(self) -> int:
        return max(self.stage_to_rank) + 1 if self.stage_to_rank else 0

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule,
            "placement": self.placement,
            "stage_to_rank": list(self.stage_to_rank),
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "training": self.training,
            "recv_placement": self.recv_placement,
            "costs": dict(self.costs),
            "actions": {str(r): [str(a) for a in acts] for r, acts in sorted(self.actions.items())},
            "releases": {str(r): {str(p): list(s) for p, s in sorted(rel.items())}
                         for r, rel in sorted(self.releases.items())},
        }

    @classmethod
    def from_json(cls, d: dict) -> "SchedulePlan":
        return cls(
            schedule=d["schedule"],
            placement=d["placement"],
            stage_to_rank=list(d["stage_to_rank"]),
            num_microbatches=int(d["num_microbatches"]),
            actions={int(r): [Action.parse(t) for t in acts] for r, acts in d["actions"].items()},
            training=bool(d.get("training", True)),
            releases={int(r): {int(p): list(s) for p, s in rel.items()} for r, rel in d.get("releases", {}).items()},
            recv_placement=d.get("recv_placement", "as given"),
            costs=dict(d.get("costs", UNIT_COSTS)),
        )


def topology_of(graph) -> Topology:
    """Which stages feed which (and which of those edges carry a gradient back), from a PipelineGraph."""
    return Topology.from_values(graph.num_stages, ((v.producer, v.consumers, v.meta.requires_grad)
                                                   for v in graph.values.values()))


def infer_stage_to_rank(actions: dict, num_stages: int, source: str = "CSV") -> list[int]:
    """Stage -> rank from which rank's list holds each stage's actions; errors if split or missing."""
    home: dict[int, tuple] = {}
    for rank in sorted(actions):
        for pos, a in enumerate(actions[rank]):
            if not 0 <= a.stage < num_stages:
                raise ValueError(f"{source}: rank {rank}, action {pos} '{a}': stage {a.stage} does not exist "
                                 f"(the model has {num_stages} stages)")
            if a.stage in home and home[a.stage][0] != rank:
                r0, p0 = home[a.stage]
                raise ValueError(
                    f"{source}: stage {a.stage} appears on rank {r0} (action {p0} "
                    f"'{actions[r0][p0]}') and on rank {rank} (action {pos} '{a}'); "
                    f"each stage must live on one rank")
            home.setdefault(a.stage, (rank, pos))
    missing = [s for s in range(num_stages) if s not in home]
    if missing:
        raise ValueError(f"{source}: stages {missing} have no actions; every stage needs a rank")
    return [home[s][0] for s in range(num_stages)]


def _read_csv(path: str, num_ranks: int, num_stages: int, topology: Topology):
    raw = load_csv(path)
    raw = {r: acts for r, acts in raw.items() if acts or r < num_ranks}
    extra = [r for r, acts in raw.items() if acts and r >= num_ranks]
    if extra:
        raise ValueError(f"{path}: rows for ranks {extra} but only {num_ranks} ranks")
    stage_to_rank = infer_stage_to_rank(raw, num_stages, source=str(path))
    if any(a.is_comm and a.peer is None for acts in raw.values() for a in acts):
        raw = resolve_peers(raw, topology)
    return stage_to_rank, {r: raw.get(r, []) for r in range(num_ranks)}


def build_plan(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int,
               topology: Topology | None = None, training: bool = True) -> SchedulePlan:
    """Plan ``schedule`` (a name in ``SCHEDULE_TABLE`` or a path ending in ``.csv``): lists, lowered, validated.

    ``topology`` defaults to a chain of ``num_stages`` stages. A CSV may be compute-only or lowered
    (peer-less torch-style comm actions are resolved from the topology); its errors are prefixed with its path.
    """
    topology = topology or Topology.chain(num_stages)
    if topology.num_stages != num_stages:
        raise ValueError(f"the topology has {topology.num_stages} stages but {num_stages} were asked for")
    check_stages_divide(num_stages, num_ranks)
    if is_csv(schedule):
        stage_to_rank, actions = _read_csv(schedule, num_ranks, num_stages, topology)
        style = "csv"
    else:
        stage_to_rank = placement(schedule, num_ranks, num_stages)
        actions = generate(schedule, num_ranks, num_stages, num_microbatches, training, topology=topology)
        style = placement_style(schedule)
    try:
        check_plan(actions, stage_to_rank, topology, num_microbatches, training)
        lowered = lower_and_replay(actions, stage_to_rank, topology, training)
        if lowered.recv_placement != "as given":
            check_plan(lowered.actions, stage_to_rank, topology, num_microbatches, training)
    except ScheduleError as err:
        if style != "csv":
            raise
        raise err.prefixed(f"{schedule}: ") from None
    return SchedulePlan(str(schedule), style, stage_to_rank, num_microbatches, lowered.actions, training,
                        releases=lowered.replay.releases, recv_placement=lowered.recv_placement,
                        costs=dict(UNIT_COSTS))
