"""``tracepp inspect``'s stage tables: per stage its rank, parameters, modules, inputs and outputs; the cost
estimates made at split time (FLOP-based time, memory held under the schedule, imbalance); and which values
cross stage boundaries and which each reading stage recomputes instead."""
from __future__ import annotations

from tabulate import tabulate

from tracepp.runtime.shapes import activation_key, activation_sent
from tracepp.split.naming import starred


def _shape(item: dict) -> str:
    return f"{item['dtype']}[{', '.join(str(d) for d in item['shape'])}]"


def stage_table(manifest: dict) -> str:
    rows = []
    for stage in manifest["stages"]:
        inputs = [f"{r['path']} {r['dtype']}" for r in manifest["root_inputs"]
                  if stage["index"] in r["stages"] and r["dtype"]]
        inputs += [f"{activation_key(item['name'], item['producer'])} {_shape(item)}" for item in stage["received"]]
        outputs = []
        for name in stage["outputs"]:
            value = manifest["values"].get(name)
            if value is not None:
                outputs += [f"{activation_sent(name, consumer)} {_shape(value)}" for consumer in value["consumers"]]
            else:
                outputs.append(f"{name} (model output)")
        modules = stage["module_fqns"]
        module_text = ", ".join(modules) if len(modules) <= 4 else f"{', '.join(modules[:2])} … {modules[-1]} ({len(modules)})"
        flops = stage.get("forward_flops")
        rank = manifest["plan"]["stage_to_rank"][stage["index"]]
        rows.append([stage["index"], rank, f"{stage['num_params']:,}",
                     f"{flops / 1e6:,.1f}" if flops else "-", module_text,
                     "\n".join(inputs) or "-", "\n".join(outputs) or "-"])
    table = tabulate(rows, headers=["stage", "rank", "params", "fwd MFLOP/mb", "modules", "inputs", "outputs"],
                     tablefmt="simple", floatfmt=["g", "g", "g", ",.1f", "g", "g", "g"])  # 12,308,300.0 not 1.23e+07
    shared = manifest.get("shared") or []
    if shared:
        table += "\n\nshared parameters (gradients summed across the stages that hold a copy):\n"
        table += tabulate([[", ".join(s["aliases"]), ", ".join(map(str, s["stages"]))] for s in shared],
                          headers=["parameter (all names)", "stages"], tablefmt="simple")
    return table


def _bytes(amount) -> str:
    if amount is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(amount) < 1024 or unit == "GiB":
            return f"{amount:,.0f} {unit}" if unit == "B" else f"{amount:,.1f} {unit}"
        amount /= 1024


def _imbalance(amounts: list):
    if not amounts or any(a is None for a in amounts) or not any(amounts):
        return None
    return max(amounts) / (sum(amounts) / len(amounts))


def estimate_table(manifest: dict) -> str:
    """Per stage: forward+backward FLOPs of one microbatch, time relative to the mean stage (from FLOPs), and
    the bytes held (parameters, gradients, optimizer state, activations x microbatches in flight); then the
    imbalance (max / mean) of time and memory. Empty when the manifest has no estimates."""
    estimates = [stage.get("estimate") or {} for stage in manifest["stages"]]
    if not all(estimates):
        return ""
    flops = [e.get("step_flops_per_microbatch") for e in estimates]
    known = all(f is not None for f in flops) and any(flops)
    mean_flops = sum(flops) / len(flops) if known else None
    memory = [e["memory_bytes"] for e in estimates]
    rows = []
    for stage, e, f in zip(manifest["stages"], estimates, flops):
        rank = manifest["plan"]["stage_to_rank"][stage["index"]]
        rows.append([stage["index"], rank, f"{f / 1e6:,.1f}" if f is not None else "-",
                     f"{f / mean_flops:.2f}" if known else "-", _bytes(e["param_bytes"]), _bytes(e["grad_bytes"]),
                     _bytes(e["optimizer_bytes"]),
                     f"{_bytes(e['activation_bytes_per_microbatch'])} x {e['inflight_microbatches']}",
                     _bytes(e["memory_bytes"])])
    text = tabulate(rows, headers=["stage", "rank", "fwd+bwd MFLOP/mb", "time (mean=1)", "params", "grads",
                                   "optimizer", "activations x in-flight", "memory"], tablefmt="simple",
                    floatfmt=["g", "g", ",.1f", ".2f", "g", "g", "g", "g", "g"])
    time_imbalance, memory_imbalance = _imbalance(flops if known else []), _imbalance(memory)
    text += ("\nimbalance (max/mean): time "
             + (f"{time_imbalance:.2f}" if time_imbalance is not None else "unknown (FLOPs not counted)")
             + (f", memory {memory_imbalance:.2f}" if memory_imbalance is not None else ""))
    if all(e.get("per_rank") for e in estimates) or manifest.get("memory"):
        text += ("\n(bytes per rank between steps: tensor-parallel pieces, this rank's routed experts (1/ep), "
                 "FSDP's share of the rest over dp)")
    text += ("\n(time from forward FLOPs counted on the traced graph (docs/flops.md), backward = 2x forward, "
             "elementwise ops not counted; ")
    if all(e.get("counted") for e in estimates):
        text += ("activations: what autograd keeps for backward per microbatch, counted on fake tensors "
                 f"({_options_text(manifest)}); the peak per rank is below)")
    else:
        text += ("memory assumes Adam (two fp32 states per parameter) and counts every value that carries a "
                 "gradient as kept for backward)")
    return text


def _options_text(manifest: dict) -> str:
    memory = manifest.get("memory") or {}
    options = memory.get("options") or {}
    run = manifest.get("run_options") or {}
    modes = options.get("recompute") or []
    checkpointing = modes[0] if modes and len(set(modes)) == 1 else ",".join(modes)
    optimizer = options.get("optimizer") or run.get("optimizer") or "sgd"
    precision = options.get('precision', 'fp32')
    if precision != "fp32" and options.get("mixed_precision"):  # params: bf16 copies of fp32 masters; autocast
        precision += f" ({options['mixed_precision']})"
    return (f"precision {precision}, activation checkpointing {checkpointing or 'none'}, optimizer {optimizer}")


PART_HEADERS = (("parameters", "params"), ("gradients", "grads"), ("optimizer", "optimizer"),
                ("fsdp_unsharded", "gathered"), ("activations", "activations"), ("received", "buffers"),
                ("transient", "temporaries"))


def memory_figures(manifest: dict) -> list:
    """Per pipeline rank (the same on each of its data- and tensor-parallel replicas): ``{"rank", "peak_bytes",
    "parts": {part: bytes}, "at", "step_peak_bytes", "optimizer_peak_bytes", "bound"}`` (``inspect --json``'s
    ``ranks``); ``bound`` is True where a stage of the rank could not be counted on fake tensors (its figure is then
    an upper bound, ``bound_stages`` says which), False where every figure is counted."""
    ranks = (manifest.get("memory") or {}).get("ranks") or []
    return [{"rank": index, **{k: v for k, v in entry.items()}, "bound": bool(entry.get("bound"))}
            for index, entry in enumerate(ranks)]


def inspect_json(manifest: dict) -> dict:
    """``tracepp inspect --json``: the figures of the tables, as plain data for scripts."""
    memory = manifest.get("memory") or {}
    return {"layout": manifest["plan"].get("mesh") or {"pp": manifest["plan"]["num_ranks"]},
            "schedule": manifest["plan"]["schedule"], "num_microbatches": manifest["plan"]["num_microbatches"],
            "run_options": manifest.get("run_options"), "memory_options": memory.get("options"),
            "memory_method": memory.get("method"), "memory_notes": memory.get("notes", []),
            "stages": [{"index": stage["index"], "rank": manifest["plan"]["stage_to_rank"][stage["index"]],
                        "num_params": stage["num_params"], "forward_flops": stage.get("forward_flops"),
                        "estimate": stage.get("estimate"),
                        "memory": (memory.get("stages") or [None] * (stage["index"] + 1))[stage["index"]]}
                       for stage in manifest["stages"]],
            "ranks": memory_figures(manifest),
            "alternatives": memory.get("alternatives")}


def memory_table(manifest: dict) -> str:
    """The peak memory of each pipeline rank over the plan's timeline, split into its parts (``codegen.peak``),
    and when it happens; empty for a folder split before memory was counted."""
    figures = memory_figures(manifest)
    if not figures:
        return ""
    rows = []
    for entry in figures:
        parts = entry.get("parts") or {}
        peak = _bytes(entry["peak_bytes"])
        if entry.get("bound"):  # a stage of this rank was not counted: its figure is an upper bound
            peak = f"<= {peak} (bound)"
        rows.append([entry["rank"], peak] + [_bytes(parts.get(key, 0)) for key, _h in PART_HEADERS]
                    + [entry.get("at", "-")])
    text = tabulate(rows, headers=["rank", "peak"] + [h for _k, h in PART_HEADERS] + ["at"], tablefmt="simple")
    text = "peak memory per rank (a step after the first, and the optimizer step):\n" + text
    text += ("\n(params: held between steps; grads: the parameters' gradients; gathered: the copy the stage "
             "computes with (FSDP's/DDP's, or the bf16 cast of --mixed-precision params); activations: kept for backward by the microbatches in flight; buffers: "
             "receive buffers and gradients waiting to be sent; temporaries: the running action's own; counted on "
             f"fake tensors, {_options_text(manifest)}; see docs/memory.md)")
    bound = [f"{entry['rank']} (stages {', '.join(map(str, entry.get('bound_stages') or []))})"
             for entry in figures if entry.get("bound")]
    if bound:
        text += (f"\nbound: the peak of rank {', '.join(bound)} is an upper bound, not a count: a stage could not run "
                 f"on fake tensors (its note below says why), so its activations are the split's estimate")
    notes = (manifest.get("memory") or {}).get("notes") or []
    for note in notes:
        text += f"\nnote: {note}"
    return text


def boundary_table(manifest: dict) -> str:
    """Which values cross stage boundaries (sent every microbatch) and which the reading stages recompute."""
    shards = (manifest.get("tp") or {}).get("sent") or {}  # sent as each tp rank's shard (its local shape here)
    rows = [[name, _shape(value), value["producer"], ",".join(map(str, value["consumers"])),
             f"sent (each tp rank its shard of dim {shards[name]})" if name in shards else "sent"]
            for name, value in manifest["values"].items()]
    rows += [[name, _shape(where), where["producer"], ",".join(map(str, where["stages"])), "recomputed"]
             for name, where in (manifest.get("recomputed") or {}).items()]
    if not rows:
        return ""
    return tabulate(rows, headers=["value", "shape", "made on stage", "read on stages", "how"], tablefmt="simple")


def verified_lines(record, what: str = "every stage's ranks") -> list:
    """The plan's verification (``split.verify``, ``split.verify_cp``, ``split.verify_ep``): verified, repaired
    (what was made whole, at which op and line, and the share it cost), or not verified and why. ``what``: who
    ran."""
    if not record:
        return ["verification: off (--verify off, or a split older than it)"]
    text = {"verified": f"verified: {what} computed what the unsharded stage does (float64, forward and backward)",
            "repaired": "repaired, then verified",
            "not verified": f"not verified: {record.get('why', '')}"}.get(record["status"], record["status"])
    lines = [f"verification: {text}"]
    for repair in record.get("repairs") or []:
        at = f" at {repair['at']}" if repair.get("at") else ""
        lines.append(f"  made whole for {repair['op']}{at} ({repair['value']}): {', '.join(repair['made_whole'])}; "
                     f"parameters sharded {repair['share_before']:.1%} -> {repair['share_after']:.1%}")
    return lines


def tensor_parallel_table(manifest: dict) -> str:
    """With --tp: each parameter's placement (repeated blocks collapsed to one row), the collectives each stage's
    forward adds, and why anything that could have been sharded was not. Empty without --tp."""
    tp = manifest.get("tp")
    if not tp:
        return ""
    size = tp["size"]
    shapes = {ref["fqn"]: ref["shape"] for stage in manifest["stages"] for ref in stage["state"]}
    rows: dict = {}
    for fqn, entry in tp["params"].items():
        dim = entry["dim"]
        shape = list(shapes.get(fqn, []))
        if dim is not None and shape:
            shape[dim] = shape[dim] // size
        placement = "Replicate()" if dim is None else f"Shard({dim})"
        if entry.get("segments"):  # a fused projection: each rank holds its part of every segment
            placement += f" of each of {len(entry['segments'])} parts"
        if entry.get("grad") == "partial":  # split/tp_grads.py: each rank's part, summed when the step ends
            placement += ", gradient summed once per step"
        key = (starred(fqn), entry["role"], placement, str(shape), entry.get("why", ""))
        rows[key] = rows.get(key, 0) + 1
    sharded = sum(1 for e in tp["params"].values() if e["dim"] is not None)
    lines = [f"tensor parallel (tp={size}): {sharded} of {len(tp['params'])} parameters sharded (the stage table's "
             f"FLOPs are per tp rank); per rank:",
             tabulate([[pattern + (f"  (x{count})" if count > 1 else ""), role, placement, shape, why]
                       for (pattern, role, placement, shape, why), count in rows.items()],
                      headers=["parameter", "role", "placement", "shape per rank", "replicated because"],
                      tablefmt="simple")]
    lines += verified_lines(tp.get("verified"))
    shares = [[index, f"{stage['share']['params']:.1%}", f"{stage['share']['flops']:.1%}"]
              for index, stage in enumerate(tp["stages"]) if "share" in stage]
    if shares:
        lines += ["", "sharded share per stage (of its parameters; of its forward FLOPs, computed on shards):",
                  tabulate(shares, headers=["stage", "parameters", "FLOPs"], tablefmt="simple")]
    lines += _bytes_beside_megatron(tp["stages"])
    comm = []
    for index, stage in enumerate(tp["stages"]):
        counts: dict = {}
        for item in stage["collectives"]:
            key = (item["op"], f"{item['dtype']}[{', '.join(item['shape'])}]")
            counts[key] = counts.get(key, 0) + 1
        text = "; ".join(f"{n} x {op} of {shape}" for (op, shape), n in counts.items()) or "none"
        comm.append([index, text])
        for reason in stage["replicated"][:3]:
            comm.append(["", f"replicated: {reason}"])
    lines += ["", "collectives per microbatch forward (their mirror runs in backward; those marked (backward) run "
                  "only there, those marked (gradient, once per step) when the step ends):",
              tabulate(comm, headers=["stage", "collectives over the tp group"], tablefmt="simple")]
    return "\n".join(lines)


def _bytes_beside_megatron(stages: list) -> list:
    """Each stage's tp traffic per microbatch (``split.plan_cost``: forward and backward, as ring collectives move
    it), layer by layer beside Megatron's plan for the same layer where that plan applies (a decoder layer: an
    all-reduce of its ``[b, s, h]`` after the attention and after the MLP, forward and backward); repeated layers
    with equal figures on one row."""
    rows = []
    for index, stage in enumerate(stages):
        if "bytes" not in stage:
            return []  # a split older than these figures
        layers: dict = {}
        for layer, (moved, megatron) in stage.get("layers", {}).items():
            key = (starred(layer), moved, megatron)
            layers[key] = layers.get(key, 0) + 1
        rows.append([index, "(whole stage)", _bytes(stage["bytes"]), "", ""])
        for (pattern, moved, megatron), count in layers.items():
            ratio = f"{moved / megatron:.2f}x" if megatron else ""
            rows.append(["", pattern + (f"  (x{count})" if count > 1 else ""), _bytes(moved),
                         _bytes(megatron) if megatron else "n/a", ratio])
    if not rows:
        return []
    return ["", "tp traffic per microbatch, forward and backward as ring collectives move it, beside Megatron's plan "
                "(2 + 2 all-reduces of each decoder layer's [b, s, h]):",
            tabulate(rows, headers=["stage", "layer", "this plan", "Megatron's", "ratio"], tablefmt="simple")]


def expert_parallel_table(manifest: dict) -> str:
    """The routed experts: each block's stage, experts per rank and (token, expert) pairs per microbatch, the
    all-to-all bytes it moves; each expert weight's shape per rank, and every parameter's placement over the
    mesh when the job spans more than the pipeline. Empty for a model without routed experts."""
    ep = manifest.get("ep")
    if not ep or not ep.get("blocks"):
        return ""
    size = ep["size"]
    rows = []
    for block in ep["blocks"]:
        moved = block.get("all_to_all_bytes")
        rows.append([block["name"], block["stage"], f"{block['local_experts']} of {block['experts']}", block["pairs"],
                     f"{_bytes(moved['forward'])} / {_bytes(moved['backward'])}" if moved else "-",
                     block.get("refused", "")])
    title = (f"routed experts (ep={size}): {len(ep['params'])} expert weights sharded over the expert dim, tokens "
             f"dispatched and combined by all-to-all (per microbatch, forward / backward, the rows that leave "
             f"the rank)" if size > 1 else "routed experts (no --ep: every rank holds all of them; tokens per "
                                            "expert are counted for the metrics)")
    lines = [title, tabulate(rows, headers=["block", "stage", "experts per rank", "pairs/mb", "all-to-all",
                                            "not sharded because"], tablefmt="simple")]
    if size > 1:  # split.verify_ep: the rewritten stages run for one ep group's ranks
        record = ep.get("verified")
        lines += verified_lines(record, f"every stage's {record.get('ranks') or 'ep ranks'}" if record else "")
        if record and record.get("scope"):
            lines.append(f"  verified: {record['scope']}")
    placements = manifest.get("placements") or {}
    if size > 1 and placements:
        grouped: dict = {}
        for fqn, entry in placements.items():
            key = (starred(fqn), entry["dp"] or "-", "-" if entry["ep"] is None else f"Shard({entry['ep']})",
                   "-" if entry["tp"] is None else f"Shard({entry['tp']})", str(entry["per_rank"]))
            grouped[key] = grouped.get(key, 0) + 1
        lines += ["", "every parameter over the mesh (shape one rank holds):",
                  tabulate([[pattern + (f"  (x{count})" if count > 1 else ""), dp, ep_dim, tp_dim, shape]
                            for (pattern, dp, ep_dim, tp_dim, shape), count in grouped.items()],
                           headers=["parameter", "dp", "ep", "tp", "per rank"], tablefmt="simple")]
    return "\n".join(lines)
