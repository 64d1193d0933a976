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
        rows.append([stage["index"], stage["rank"], f"{stage['num_params']:,}", module_text,
                     "\n".join(inputs) or "-", "\n".join(outputs) or "-"])
    table = tabulate(rows, headers=["stage", "rank", "params", "modules", "inputs", "outputs"], tablefmt="simple")
    shared = manifest.get("shared") or []
    if shared:
        table += "\n\nshared parameters (gradients summed across the stages that hold a copy):\n"
        table += tabulate([[", ".join(s["aliases"]), ", ".join(map(str, s["stages"]))] for s in shared],
                          headers=["parameter (all names)", "stages"], tablefmt="simple")
    return table


def topology_from_manifest(manifest: dict) -> Topology:
    fwd, grad = set(), set()
    for value in manifest["values"].values():
        for consumer in value["consumers"]:
            fwd.add((value["producer"], consumer))
            if value["requires_grad"]:
                grad.add((value["producer"], consumer))
    return Topology(len(manifest["stages"]), tuple(sorted(fwd)), tuple(sorted(grad)))


def _simulate(manifest: dict, costs=None):
    from tracepp.codegen.simulate import simulate

    plan = manifest["plan"]
    actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
    return simulate(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                    costs=costs, training=manifest["training"])


def plan_report(manifest: dict, grid: bool = True) -> str:
    from tracepp.codegen.visualize import format_grid

    plan = manifest["plan"]
    sim = _simulate(manifest)
    lines = [f"schedule {plan['schedule']} ({plan.get('placement', '?')} placement): {plan['num_ranks']} ranks, "
             f"{plan['num_stages']} stages, {plan['num_microbatches']} microbatches"]
    rows = [[rank, ", ".join(str(s) for s, r in enumerate(plan["stage_to_rank"]) if r == rank),
             len(plan["actions"][str(rank)]), f"{sim.bubble[rank]:.1%}", sim.peak_inflight[rank]]
            for rank in sorted(sim.timeline)]
    lines.append(tabulate(rows, headers=["rank", "stages", "actions", "bubble", "peak in-flight"], tablefmt="simple"))
    lines.append(f"simulated with unit costs (F=1, B=2, I=W=1, comms free): makespan {sim.makespan:g}, "
                 f"bubble {sim.bubble_overall:.1%}")
    if grid:
        actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
        lines.append("")
        lines.append(format_grid(actions, plan["stage_to_rank"]))
    return "\n".join(lines)


def write_plan_pictures(manifest: dict, svg_path=None, trace_path=None) -> list:
    from tracepp.codegen.visualize import write_chrome_trace, write_svg

    folder = manifest.get("_folder", ".")
    sim = _simulate(manifest)
    svg_path = svg_path or os.path.join(folder, "plan.svg")
    trace_path = trace_path or os.path.join(folder, "plan_trace.json")
    write_svg(sim, svg_path)
    write_chrome_trace(sim, trace_path)
    return [svg_path, trace_path]
