"""``tracepp inspect``'s stage table: per stage its rank, parameters, modules, inputs, outputs and cost estimates."""
from __future__ import annotations

from tabulate import tabulate


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
