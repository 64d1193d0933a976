"""Step 3, plan: stages to ranks, the schedule's per-rank action lists, comms inserted, validated.

Takes the PipelineGraph's data-flow between stages (which stage feeds which, and which of those edges carry
gradients back) and returns the plan as plain JSON-able data for the manifest.
"""
from __future__ import annotations

from tracepp.codegen.actions import Topology


def topology_of(graph) -> Topology:
    return Topology.from_values(graph.num_stages, ((v.producer, v.consumers, v.meta.requires_grad)
                                                   for v in graph.values.values()))


def stages_per_rank(schedule: str) -> int:
    """Stages each rank holds by default: two for the multi-stage schedules, one otherwise (and for CSVs)."""
    return 2 if schedule in ("interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev") else 1


def check_stages_divide(num_stages: int, num_ranks: int) -> None:
    """The one check (and message) that every rank holds the same number of stages; the CLI calls it before
    tracing when --stages is given, :func:`plan` after splitting when split points chose the count."""
    if num_stages % num_ranks:
        lo = max(num_ranks, num_stages // num_ranks * num_ranks)
        raise ValueError(f"{num_stages} stages cannot be spread evenly over {num_ranks} ranks: use --stages "
                         f"a multiple of --ranks {num_ranks} (e.g. --stages {lo} or {lo + num_ranks}), or split "
                         f"points that make such a number of stages")


def plan(graph, schedule: str, num_ranks: int, num_microbatches: int, training: bool) -> dict:
    from tracepp.codegen.planning import build_plan

    check_stages_divide(graph.num_stages, num_ranks)
    built = build_plan(schedule, num_ranks, graph.num_stages, num_microbatches, topology_of(graph), training)
    result = built.to_json()
    result.update(num_ranks=num_ranks, num_stages=graph.num_stages)
    return result
