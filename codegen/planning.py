"""Entry point for schedule planning: a schedule name (or a user CSV) -> a lowered, validated plan."""
from __future__ import annotations

from dataclasses import dataclass, field

from .actions import Action, Topology
from .csvio import load_csv, resolve_peers
from .lower import lower
from .schedules import SCHEDULES, generate, placement, placement_style
from .simulate import ScheduleError, check_compute, validate


@dataclass
class SchedulePlan:
    """A complete pipeline plan: per-rank action lists with comm actions, checked by :func:`validate`.

    ``placement`` is "loop", "v" or "csv" (stage -> rank map taken from a user CSV).
    """

    schedule: str
    placement: str
    stage_to_rank: list
    num_microbatches: int
    actions: dict = field(default_factory=dict)  # rank -> list[Action]
    training: bool = True

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
            "num_microbatches": self.num_microbatches,
            "training": self.training,
            "actions": {str(r): [str(a) for a in acts] for r, acts in sorted(self.actions.items())},
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
        )


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


def build_plan(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int,
               topology: Topology | None = None, training: bool = True) -> SchedulePlan:
    """Plan ``schedule`` (a name in ``SCHEDULES`` or a path ending in ``.csv``) and lower + validate it.

    ``topology`` defaults to a chain of ``num_stages`` stages. A CSV may be compute-only or lowered
    (peer-less torch-style comm actions are resolved from the topology).
    """
    topology = topology or Topology.chain(num_stages)
    if topology.num_stages != num_stages:
        raise ValueError(f"the topology has {topology.num_stages} stages but {num_stages} were asked for")
    if str(schedule).lower().endswith(".csv"):
        raw = load_csv(schedule)
        raw = {r: acts for r, acts in raw.items() if acts or r < num_ranks}
        extra = [r for r, acts in raw.items() if acts and r >= num_ranks]
        if extra:
            raise ValueError(f"{schedule}: rows for ranks {extra} but only {num_ranks} ranks")
        stage_to_rank = infer_stage_to_rank(raw, num_stages, source=str(schedule))
        if any(a.is_comm and a.peer is None for acts in raw.values() for a in acts):
            raw = resolve_peers(raw, topology)
        actions = {r: raw.get(r, []) for r in range(num_ranks)}
        try:
            if not any(a.is_comm for acts in actions.values() for a in acts):  # compute-only: check first
                check_compute(actions, stage_to_rank, topology, num_microbatches, training)
            lowered = lower(actions, stage_to_rank, topology, training)
            validate(lowered, stage_to_rank, topology, num_microbatches, training)
        except ScheduleError as err:
            raise ScheduleError(f"{schedule}: {err}") from None
        return SchedulePlan(str(schedule), "csv", stage_to_rank, num_microbatches, lowered, training)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}, "
                         f"or a path to a .csv file")
    stage_to_rank = placement(schedule, num_ranks, num_stages)
    compute = generate(schedule, num_ranks, num_stages, num_microbatches, training, topology=topology)
    lowered = lower(compute, stage_to_rank, topology, training)
    validate(lowered, stage_to_rank, topology, num_microbatches, training)
    return SchedulePlan(schedule, placement_style(schedule), stage_to_rank, num_microbatches, lowered, training)
