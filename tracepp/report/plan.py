"""``tracepp plan`` / ``tracepp inspect``'s plan section: replay the manifest's plan in the simulator and report
bubbles, peak in-flight microbatches, the action grid and pictures (SVG, Chrome trace)."""
from __future__ import annotations

import os

from tabulate import tabulate

from tracepp.codegen.manifest import topology_from_manifest
from tracepp.runtime.actions import Action
from tracepp.runtime.replay import UNIT_COSTS

UNIT_TEXT = ", ".join(f"{kind}={cost:g}" for kind, cost in UNIT_COSTS.items())


def _simulate(manifest: dict, costs=None):
    from tracepp.codegen.simulate import simulate

    plan = manifest["plan"]
    actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
    return simulate(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                    costs=costs, training=manifest["training"])


def _describe_costs(costs) -> str:
    if not costs:
        return f"unit costs ({UNIT_TEXT}, comms free)"
    parts = [f"{key}={value:g}" for key, value in costs.items() if isinstance(key, str)]
    parts += [f"{s}{k}={value:g}" for (s, k), value in sorted((k, v) for k, v in costs.items()
                                                              if isinstance(k, tuple))]
    return f"measured costs ({', '.join(parts)}; unlisted: {UNIT_TEXT}; comms free)"


def flop_costs(manifest: dict):
    """Per-stage action costs from the stages' forward FLOPs (scaled so the mean F is 1; B, I, W in the unit
    costs' proportions to F), or None."""
    flops = [stage.get("forward_flops") for stage in manifest["stages"]]
    if not flops or not all(flops):
        return None
    mean = sum(flops) / len(flops)
    costs = {}
    for index, value in enumerate(flops):
        f = value / mean
        costs.update({(index, kind): f * unit / UNIT_COSTS["F"] for kind, unit in UNIT_COSTS.items()})
    return costs


def plan_report(manifest: dict, grid: bool = True, costs=None) -> str:
    from tracepp.codegen.visualize import format_grid

    plan = manifest["plan"]
    sim = _simulate(manifest, costs)
    lines = [f"schedule {plan['schedule']} ({plan.get('placement', '?')} placement): {plan['num_ranks']} ranks, "
             f"{plan['num_stages']} stages, {plan['num_microbatches']} microbatches"]
    rows = [[rank, ", ".join(str(s) for s, r in enumerate(plan["stage_to_rank"]) if r == rank),
             len(plan["actions"][str(rank)]), f"{sim.bubble[rank]:.1%}", sim.peak_inflight[rank]]
            for rank in sorted(sim.timeline)]
    lines.append(tabulate(rows, headers=["rank", "stages", "actions", "bubble", "peak in-flight"], tablefmt="simple"))
    lines.append(f"simulated with {_describe_costs(costs)}: makespan {sim.makespan:g}, "
                 f"bubble {sim.bubble_overall:.1%}")
    estimated = flop_costs(manifest)
    if costs is None and estimated:
        flop_sim = _simulate(manifest, estimated)
        lines.append(f"with FLOP-estimated costs (F per stage from its forward FLOPs, B, I, W in the unit costs' "
                     f"proportions): bubble "
                     f"{flop_sim.bubble_overall:.1%}, per rank "
                     + ", ".join(f"{flop_sim.bubble[r]:.1%}" for r in sorted(flop_sim.timeline)))
    if grid:
        actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
        lines.append("")
        lines.append(format_grid(actions, plan["stage_to_rank"]))
    return "\n".join(lines)


def write_plan_pictures(manifest: dict, svg_path=None, trace_path=None, costs=None) -> list:
    from tracepp.codegen.visualize import write_chrome_trace, write_svg

    folder = manifest.get("_folder", ".")
    sim = _simulate(manifest, costs)
    svg_path = svg_path or os.path.join(folder, "plan.svg")
    trace_path = trace_path or os.path.join(folder, "plan_trace.json")
    write_svg(sim, svg_path)
    write_chrome_trace(sim, trace_path)
    return [svg_path, trace_path]
