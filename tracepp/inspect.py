"""``tracepp inspect`` / ``tracepp plan``: what an output folder will do, before anyone launches it."""
from __future__ import annotations

import json
import os

from tabulate import tabulate

from tracepp.codegen.actions import Action, Topology


def load_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: pass a folder written by `tracepp split`")
    with open(path) as handle:
        manifest = json.load(handle)
    manifest["_folder"] = out_dir
    return manifest


def _shape(item: dict) -> str:
    return f"{item['dtype']}[{', '.join(str(d) for d in item['shape'])}]"


def stage_table(manifest: dict) -> str:
    rows = []
    for stage in manifest["stages"]:
        inputs = [f"{r['path']} {r['dtype']}" for r in manifest["root_inputs"]
                  if stage["index"] in r["stages"] and r["dtype"]]
        inputs += [f"{item['name']} {_shape(item)} <- stage {item['producer']}" for item in stage["received"]]
        outputs = []
        for name in stage["outputs"]:
            value = manifest["values"].get(name)
            if value is not None:
                outputs.append(f"{name} {_shape(value)} -> stage {','.join(map(str, value['consumers']))}")
            else:
                outputs.append(f"{name} (model output)")
        modules = stage["module_fqns"]
        module_text = ", ".join(modules) if len(modules) <= 4 else f"{', '.join(modules[:2])} … {modules[-1]} ({len(modules)})"
        flops = stage.get("forward_flops")
        rows.append([stage["index"], stage["rank"], f"{stage['num_params']:,}",
                     f"{flops / 1e6:,.1f}" if flops else "-", module_text,
                     "\n".join(inputs) or "-", "\n".join(outputs) or "-"])
    table = tabulate(rows, headers=["stage", "rank", "params", "fwd MFLOP/mb", "modules", "inputs", "outputs"],
                     tablefmt="simple")
    shared = manifest.get("shared") or []
    if shared:
        table += "\n\nshared parameters (gradients summed across the stages that hold a copy):\n"
        table += tabulate([[", ".join(s["aliases"]), ", ".join(map(str, s["stages"]))] for s in shared],
                          headers=["parameter (all names)", "stages"], tablefmt="simple")
    return table


def topology_from_manifest(manifest: dict) -> Topology:
    return Topology.from_values(len(manifest["stages"]), ((v["producer"], v["consumers"], v["requires_grad"])
                                                          for v in manifest["values"].values()))


def _simulate(manifest: dict, costs=None):
    from tracepp.codegen.simulate import simulate

    plan = manifest["plan"]
    actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
    return simulate(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                    costs=costs, training=manifest["training"])


def load_costs(path: str, num_stages: int) -> dict:
    """Read measured compute times for ``tracepp plan --costs``: ``{"F": 1.0, "B": 2.0}`` per action kind,
    ``{"0F": 1.2, "1B": 2.5}`` per stage, or both (a stage's own entry wins).

    Returns the mapping :func:`tracepp.codegen.simulate.cost_of` reads (kind or (stage, kind) -> time).
    A ``B`` given without ``I`` and ``W`` at the same level also prices the split backward: I = W = B / 2.
    """
    import re

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--costs {path}: no such file")
    with open(path) as handle:
        try:
            raw = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"--costs {path}: not valid JSON ({error}); expected e.g. "
                             f'{{"F": 1.0, "B": 2.0}} or {{"0F": 1.2, "1B": 2.5}}') from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--costs {path}: expected a non-empty JSON object such as "
                         f'{{"F": 1.0, "B": 2.0}} or {{"0F": 1.2, "1B": 2.5}}, got {type(raw).__name__}')
    costs: dict = {}
    for key, value in raw.items():
        match = re.fullmatch(r"(\d+)?([FBIW])", str(key).strip())
        if not match:
            raise ValueError(f"--costs {path}: key {key!r} is not an action kind (F, B, I, W) or a stage "
                             f"followed by one (e.g. '0F', '3B')")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"--costs {path}: {key!r} is {value!r}; times must be positive numbers")
        stage, kind = match.groups()
        if stage is None:
            costs[kind] = float(value)
        else:
            if int(stage) >= num_stages:
                raise ValueError(f"--costs {path}: key {key!r} names stage {stage}, but the plan has stages "
                                 f"0..{num_stages - 1}")
            costs[(int(stage), kind)] = float(value)
    for scope in [None] + list(range(num_stages)):
        name = (lambda kind: kind) if scope is None else (lambda kind, s=scope: (s, kind))
        if name("B") in costs and name("I") not in costs and name("W") not in costs:
            costs[name("I")] = costs[name("W")] = costs[name("B")] / 2
    return costs


def _describe_costs(costs) -> str:
    if not costs:
        return "unit costs (F=1, B=2, I=W=1, comms free)"
    parts = [f"{key}={value:g}" for key, value in costs.items() if isinstance(key, str)]
    parts += [f"{s}{k}={value:g}" for (s, k), value in sorted((k, v) for k, v in costs.items()
                                                              if isinstance(k, tuple))]
    return f"measured costs ({', '.join(parts)}; unlisted: F=1, B=2, I=W=1; comms free)"


def flop_costs(manifest: dict):
    """Per-stage action costs from the stages' forward FLOPs (scaled so the mean F is 1), or None."""
    flops = [stage.get("forward_flops") for stage in manifest["stages"]]
    if not flops or not all(flops):
        return None
    mean = sum(flops) / len(flops)
    costs = {}
    for index, value in enumerate(flops):
        f = value / mean
        costs.update({(index, "F"): f, (index, "B"): 2 * f, (index, "I"): f, (index, "W"): f})
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
        lines.append(f"with FLOP-estimated costs (F per stage from its forward FLOPs, B=2F, I=W=F): bubble "
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
