"""Step 4, emit: write the output folder that torchrun runs.

``manifest.json`` (the plan's record for tools and the metadata), ``rank{R}.py`` per rank (the program of that
rank: the stage code from fx, its ``ACTIONS`` and its send-release points ``RELEASES``, with a header saying how
the plan was made), ``run.py`` (the torchrun entry point), ``model_file.py`` (a copy of the model file, for
``loss_fn``/``batch``/``optimizer``) and ``tracepp_runtime/`` (a copy of the runtime, so the folder runs
where only torch is installed). No parameter data is written: each rank materialises its own stages at run
time (``runtime/weights.py``); only constants that export created while tracing (not the model's attributes)
go to ``constants.pt``.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import re
import shutil
import textwrap

import torch
import torch.utils._pytree as pytree

import tracepp
from tracepp.codegen.stage_code import globals_prelude, loss_source, rank_code
from tracepp.codegen.workers import forked_map, workers_for
from tracepp.runtime.loading import MANIFEST_FORMAT
from tracepp.runtime.mesh import describe, mesh_layout, parameter_placements
from tracepp.runtime.run_options import RunOptions
from tracepp.runtime.script_check import program_digest
from tracepp.runtime.shapes import activation_key, activation_sent, gradient_key, gradient_sent
from tracepp.runtime.weights import held_state
from tracepp.split.cost import forward_flops

RUNTIME_PACKAGE = "tracepp_runtime"


def _saves_another_layout(model: torch.nn.Module) -> bool:
    """Whether ``model.state_dict()`` differs from the tensors its modules hold (a name added or gone, or another
    tensor under a name): a module's state_dict hook saves another layout (torchtitan's fused qkv)."""
    held = held_state(model)
    saved = model.state_dict(keep_vars=True)
    return saved.keys() != held.keys() or any(saved[fqn] is not tensor for fqn, tensor in held.items())


def _spec_text(spec):
    try:
        return {"json": pytree.treespec_dumps(spec)}
    except Exception:  # e.g. a model-output class without a registered serializer: pickle it instead
        return {"pickle": base64.b64encode(pickle.dumps(spec)).decode()}


def _spec_types(*specs) -> list:
    """``module:qualname`` of every non-builtin node type in the specs (the runtime imports them first)."""
    found, todo = set(), [spec for spec in specs if spec is not None]
    while todo:
        spec = todo.pop()
        kind = spec.type
        # the model file's own classes come back with it (it is imported first), under another module name
        if kind is not None and kind.__module__ not in ("builtins", "collections") \
                and not kind.__module__.startswith("tracepp_user_model_"):
            found.add(f"{kind.__module__}:{kind.__qualname__}")
        todo.extend(spec.children())
    return sorted(found)


def _import_paths(model_path: str) -> list:
    """The model file's folder, and the working directory where it differs: where its own imports live."""
    paths = [os.path.dirname(os.path.abspath(model_path))]
    if os.getcwd() not in paths:
        paths.append(os.getcwd())
    return paths


def _plan_record(plan: dict) -> dict:
    """The plan as the manifest records it: with each rank's program digest (ACTIONS and RELEASES, which the
    runtime compares at start-up, see ``runtime/script_check``). The release points themselves are the rank
    scripts' data; the in-memory plan keeps them for :func:`rank_script` and ``emit`` drops them from the file."""
    record = dict(plan)
    releases = plan.get("releases", {})
    record["digests"] = {rank: program_digest(actions, releases.get(rank, {}))
                         for rank, actions in sorted(plan["actions"].items())}
    return record


def build_manifest(model_file, traced, graph, plan, launch_command: str, options=None) -> dict:
    model = traced.model
    named_params = dict(model.named_parameters(remove_duplicate=False))
    stages = []
    for stage in graph.stages:
        state = []
        placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
        for position, name in enumerate(stage.state):
            ref = graph.state[name]
            param = named_params.get(ref.fqn)
            value = _program_tensor(traced.program, ref.fqn, ref.kind)
            # the dtype the rank holds it in: its own (the master weight) where the program was traced with it cast
            held = (getattr(traced, "master_dtypes", None) or {}).get(ref.fqn, value.dtype)
            entry = {"fqn": ref.fqn, "aliases": ref.aliases, "kind": ref.kind,
                     "persistent": ref.persistent,
                     "requires_grad": bool(param.requires_grad) if param is not None else False,
                     "shape": list(value.shape), "dtype": str(held).replace("torch.", ""),
                     "numel": value.numel()}
            if held != value.dtype:  # --mixed-precision params: the stage code computes with this dtype's copy
                entry["compute_dtype"] = str(value.dtype).replace("torch.", "")
            node = placeholders[position] if position < len(placeholders) else None
            if ref.kind == "parameter" and node is not None and any(
                    user.target is torch.ops.aten.linear.default and len(user.args) > 1 and user.args[1] is node
                    for user in node.users):
                entry["linear_weight"] = True  # --precision fp8: what torchao's float8 takes (and gathers)
            state.append(entry)
        received = [dict(producer=p, name=n, **graph.values[n].meta.to_json()) for p, n in stage.received]
        output_node = next(n for n in stage.graph.nodes if n.op == "output")
        returned_only = [isinstance(n, torch.fx.Node) and len(n.users) == 1 and n.op != "placeholder"
                         for n in output_node.args[0]]
        stages.append({
            "index": stage.index, "function": f"stage{stage.index}_forward",
            "state": state,
            "root_inputs": stage.root_inputs,
            "root_leaf_indices": [graph.root_inputs[name].leaf_index for name in stage.root_inputs],
            "received": received, "outputs": stage.outputs,
            "outputs_returned_only": returned_only[:len(stage.outputs)],
            "module_fqns": stage.module_fqns,
            "sym_inputs": [{"name": name, "expr": expr} for name, expr in stage.sym_inputs],
            "num_params": sum(s["numel"] for s in state if s["kind"] == "parameter"),
            "forward_flops": forward_flops(stage),
            "estimate": stage.estimate,
        })
    root_inputs = []
    for ref in graph.root_inputs.values():
        entry = {"leaf_index": ref.leaf_index, "path": ref.path,
                 "batched": ref.batched, "stages": ref.stages, "shape": None, "dtype": None}
        if ref.meta is not None:
            entry.update(shape=ref.meta.to_json()["shape"], dtype=ref.meta.dtype)
            leaf = traced.example_leaves[ref.leaf_index] if ref.leaf_index < len(traced.example_leaves) else None
            if isinstance(leaf, torch.Tensor) and str(leaf.dtype).replace("torch.", "") != ref.meta.dtype:
                # --mixed-precision params: a floating input traced in the compute dtype; the batch keeps its own
                # (the runtime casts it, as FSDP2's cast_forward_inputs does)
                entry.update(dtype=str(leaf.dtype).replace("torch.", ""), compute_dtype=ref.meta.dtype)
        else:  # a Python scalar: export baked its value into the graph, so every batch must repeat it
            leaf = traced.example_leaves[ref.leaf_index]
            if isinstance(leaf, (bool, int, float, str)):
                entry["constant"] = leaf
        root_inputs.append(entry)
    return {
        "format": MANIFEST_FORMAT,
        "tracepp_version": tracepp.__version__,
        "torch_version": torch.__version__,
        "model_file": os.path.basename(model_file.path),
        "model_sha256": model_file.sha256,
        "launch_command": launch_command,
        "training": model_file.training,
        "batch_size": traced.batch_size,
        "batched_leaves": traced.batched_leaves,
        "batch_dim": traced.batch_dim,  # the dim of the batched inputs and the target holding the samples
        "in_spec": _spec_text(graph.in_spec), "out_spec": _spec_text(graph.out_spec),
        "spec_types": _spec_types(graph.in_spec, graph.out_spec),
        "import_paths": _import_paths(model_file.path),
        "output_leaves": [[kind, value] for kind, value in graph.output_leaves],
        "root_inputs": root_inputs,
        "token_input": _token_input(traced, graph),  # what run.py --data feeds (None: batch(step) only)
        "values": {name: {"producer": v.producer, "consumers": v.consumers, **v.meta.to_json()}
                   for name, v in graph.values.items()},
        "stages": stages,
        "recomputed": graph.recomputed,
        "segments": graph.segments,  # where a re-split may cut and what each piece costs (the tuner)
        "shared": [{"fqn": ref.fqn, "aliases": ref.aliases, "stages": ref.stages} for ref in graph.shared_state()],
        "state_dict_keys": list(held_state(model)),  # what the ranks hold, by every FQN
        # the model's modules save another layout than they hold (state_dict hooks): --save writes theirs
        "state_dict_hooks": _saves_another_layout(model),
        # read by no stage: rank 0 materialises them only to write them back with --save
        "unused_state": [{"fqn": fqn, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}
                         for fqn, tensor in graph.unused_state.items()],
        "symbols": graph.symbols,
        "batch_symbol": graph.batch_symbol,
        "plan": _plan_record(plan),
        "random_ops": list(traced.random_ops),  # ops that draw random numbers (eager differs by their draws)
        "notes": list(traced.notes),  # what tracing noticed (e.g. a size baked in), printed by the CLI
        "warnings": list(getattr(traced, "warnings", [])),  # what makes a pipelined run differ from eager
        # the loss a mean over the tokens its target does not ignore: how each microbatch's are counted (its weight)
        "token_mean": graph.token_mean,
        # what the FLOP count could not see, or assumed (split.cost.FlopCount); its warnings printed by the CLI
        "flop_count": dict(graph.flop_count, warnings=list(graph.flop_warnings)),
        # with --tp: each parameter's shard dim (None: replicated over tp) and the collectives per stage
        "tp": graph.tensor_parallel or None,
        "ep": graph.expert_parallel or None,
        # with --cp: the sequence length, the chunk order, per stage the cuts and key/value gathers, the loss
        "cp": graph.context_parallel or None,
        # what each stage keeps per microbatch (counted on fake tensors) and each pipeline rank's peak with its parts
        "memory": graph.memory or None,
        # what run.py defaults to: the precision, activation checkpointing and optimizer the memory was planned for
        "run_options": (options or {}).get("run_options") or RunOptions().to_json(),
        # every parameter's placement over the whole mesh (dp, ep, tp) and the shape one rank holds
        "placements": parameter_placements(mesh_layout(plan), {
            ref.fqn: list(_program_tensor(traced.program, ref.fqn, ref.kind).shape)
            for ref in graph.state.values() if ref.kind == "parameter"}, graph.tensor_parallel or {},
            graph.expert_parallel or {}),
        # how `tracepp split` was called (model file path, ranks, stages, ...): what a re-split (the tuner's
        # --apply) repeats with other choices
        "split_options": dict(options or {}),
    }


def _program_tensor(program, fqn: str, kind: str) -> torch.Tensor:
    # export keeps non-persistent buffers (e.g. a rotary inv_freq) in `constants`, not in `state_dict`
    if kind == "constant" or fqn not in program.state_dict:
        return program.constants[fqn]
    return program.state_dict[fqn]


def _traced_constants(traced, manifest: dict) -> dict:
    """Constants the stages read that are not attributes of the model (tensors export created in forward):
    the runtime cannot rebuild them from ``model()``, so their (small, real) values are written out."""
    created = {}
    for stage in manifest["stages"]:
        for ref in stage["state"]:
            if ref["kind"] != "constant" or _has_attribute(traced.model, ref["fqn"]):
                continue
            value = _program_tensor(traced.program, ref["fqn"], ref["kind"])
            if not value.is_meta:
                created[ref["fqn"]] = value.detach().clone().contiguous()
    return created


def _has_attribute(model, fqn: str) -> bool:
    owner = model
    for part in fqn.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return isinstance(owner, torch.Tensor)


def _header(manifest: dict, rank: int, rank_stages: list) -> str:
    plan = manifest["plan"]
    lines = [
        f"tracepp pipeline, rank {rank} of {plan['num_ranks']}: stage(s) {', '.join(str(s['index']) for s in rank_stages)} "
        f"of {plan['num_stages']}.",
        "",
        f"Generated by tracepp {manifest['tracepp_version']} (torch {manifest['torch_version']}) from "
        f"{manifest['model_file']} (sha256 {manifest['model_sha256'][:16]}).",
        f"World size: {mesh_layout(plan).world_size} | schedule: {plan['schedule']} ({plan.get('placement', '?')} placement) "
        f"| microbatches: {plan['num_microbatches']} | mode: {'training' if manifest['training'] else 'forward only'}",
        f"Launch (all ranks): {manifest['launch_command']}   # from this folder",
        *_precision_lines(manifest),
        *_provenance(manifest, rank),
        *describe(plan),
        "",
    ]
    for stage in rank_stages:
        modules = ", ".join(stage["module_fqns"]) or "-"
        lines.append(f"Stage {stage['index']}: {stage['num_params']:,} parameters; modules: {modules}")
        lines += _boundary_lines(manifest, stage)
    mine = {stage["index"] for stage in rank_stages}
    for shared in manifest.get("shared") or []:
        here = [s for s in shared["stages"] if s in mine]
        if not here:
            continue
        names = " = ".join(shared["aliases"])
        elsewhere = [s for s in shared["stages"] if s not in mine]
        where = f"stages {', '.join(map(str, here))} use one tensor on this rank" if len(here) > 1 else \
            f"stage {here[0]} holds a copy"
        if elsewhere:
            where += f"; gradients summed with stage(s) {', '.join(map(str, elsewhere))} on other ranks"
        lines.append(f"Shared parameter {names}: {where}")
    lines += ["", "ACTIONS and RELEASES below are this rank's program and may be edited: at start-up every rank gathers",
              "all ranks' programs, and where one differs from its digest the whole plan is validated again: it runs",
              "as edited, or every rank stops naming the line and the rule it breaks. For anything else re-run",
              "`tracepp split`. manifest.json holds the plan and the metadata."]
    return '"""' + "\n".join(lines) + '\n"""'


def _precision_lines(manifest: dict) -> list:
    """What the functions below compute in, where it is not what the rank holds (``--mixed-precision params``)."""
    run = manifest.get("run_options") or {}
    precision = run.get("precision", "fp32")
    if precision == "fp32" or run.get("mixed_precision", "autocast") != "params":
        return []
    half = "bf16" if precision == "fp8" else precision
    text = (f"Precision: {precision} (--mixed-precision params): the rank holds its parameters in fp32 (master weights); "
            f"the functions below get their {half} copy, made once per step")
    if precision == "fp8":
        text += (f"; each torch.ops.aten.linear.default of a parameter runs as torchao's float8 matmul "
                 f"({run.get('fp8_recipe', 'tensorwise')} scaling)")
    import textwrap

    return textwrap.wrap(text, 110)


_RECV_PLACEMENTS = {
    "timed": "posted after the last compute that starts before the matching send is due",
    "early": "posted after the last compute that ends before the matching send is due",
    "as given": "as the CSV lists them",
}


def _provenance(manifest: dict, rank: int) -> list:
    """How the plan was made: generator, receive placement, the costs behind both, this rank's digest."""
    plan = manifest["plan"]
    schedule = plan["schedule"]
    generator = (f"the CSV {os.path.basename(schedule)} (placement from its rows)" if plan["placement"] == "csv"
                 else f"schedule {schedule}")
    costs = ", ".join(f"{kind}={cost:g}" for kind, cost in plan["costs"].items())
    placed = plan["recv_placement"]
    text = (f"Plan: generated by tracepp {manifest['tracepp_version']} from {generator}. Receives placed "
            f"'{placed}': {_RECV_PLACEMENTS.get(placed, placed)}, in a replay with the unit costs {costs} (which "
            f"also time the deferred W's and the greedy V orders). This rank's program digest: "
            f"{plan['digests'][str(rank)]} (manifest.json plan.digests).")
    return textwrap.wrap(text, width=110, break_long_words=False, break_on_hyphens=False)


def _boundary_lines(manifest: dict, stage: dict) -> list:
    """What a stage receives and sends, by the names its code uses, with the gradients going the other way."""
    lines = []
    for item in stage["received"]:
        grad = f"; sends {gradient_sent(item['name'], item['producer'])} back" if item["requires_grad"] else ""
        lines.append(f"  receives {activation_key(item['name'], item['producer'])} {_type(item)}{grad}")
    for name in stage["outputs"]:
        value = manifest["values"].get(name)
        for consumer in (value or {}).get("consumers", []):
            grad = f"; receives {gradient_key(name, consumer)} back" if value["requires_grad"] else ""
            lines.append(f"  sends {activation_sent(name, consumer)} {_type(value)}{grad}")
    return lines


def _type(item: dict) -> str:
    return f"{item['dtype']}[{', '.join(str(d) for d in item['shape'])}]"


_COMPUTE_RE = re.compile(r"^\d+[FBIW]\d+$")


def _actions_literal(actions: list) -> str:
    """One line per compute action, with the receives posted before it and the sends that follow it."""
    if not actions:
        return "ACTIONS = []"
    lines, current, seen_compute = [], [], False
    for action in map(str, actions):
        is_compute = bool(_COMPUTE_RE.match(action))
        if seen_compute and (is_compute or "RECV" in action):  # a new compute step begins
            lines.append(current)
            current, seen_compute = [], False
        current.append(action)
        seen_compute = seen_compute or is_compute
    lines.append(current)
    body = []
    for group in lines:
        text = ", ".join(f'"{a}"' for a in group) + ","
        body.append(textwrap.fill(text, width=108, initial_indent="    ", subsequent_indent="    ",
                                  break_long_words=False, break_on_hyphens=False))
    return "ACTIONS = [\n" + "\n".join(body) + "\n]"


def _releases_literal(actions: list, releases: dict) -> str:
    """``RELEASES = {position: [send positions]}``, one entry a line with the actions named in a comment."""
    if not releases:
        return "RELEASES = {}"
    actions = [str(a) for a in actions]
    body = []
    for position, sends in sorted((int(p), s) for p, s in releases.items()):
        named = ", ".join(f"'{actions[send]}'" for send in sends)
        body.append(f"    {position}: {list(sends)},  # after '{actions[position]}': {named}")
    return "RELEASES = {\n" + "\n".join(body) + "\n}"


def rank_scripts(manifest: dict, graph, model_path: str) -> list:
    """Every rank's script (:func:`rank_script`), printed by forked workers where the stages are many and large
    (``codegen.workers``: a 671B model's 16 ranks on 2 CPUs in half the time), else here."""
    ranks = list(range(manifest["plan"]["num_ranks"]))
    to_rank = manifest["plan"]["stage_to_rank"]

    def nodes(rank: int) -> int:
        return sum(len(stage.graph.nodes) for stage in graph.stages if to_rank[stage.index] == rank)

    workers = workers_for(len(ranks), sum(len(stage.graph.nodes) for stage in graph.stages))
    if workers > 1:
        try:
            return forked_map(lambda rank: rank_script(manifest, rank, graph, model_path), ranks, workers, nodes)
        except Exception:  # noqa: BLE001 - a pool that cannot start: print them here
            pass
    return [rank_script(manifest, rank, graph, model_path) for rank in ranks]


def rank_script(manifest: dict, rank: int, graph, model_path: str, extract_blocks: bool = True) -> str:
    rank_stages = [s for s in manifest["stages"] if manifest["plan"]["stage_to_rank"][s["index"]] == rank]
    code = rank_code([(graph.stages[stage["index"]], stage["function"]) for stage in rank_stages], model_path,
                     graph.symbol_aliases, extract_blocks)
    sources = []
    for function, source in code.blocks:
        paths = [block.path for block in function.blocks]
        where = ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, {paths[1]} … {paths[-1]} ({len(paths)})"
        sources.append(f"# ---- {function.name}: one traced graph for the blocks {where}; the stages call it per "
                       f"block\n{source}")
    for stage, (_index, source) in zip(rank_stages, code.stages):
        modules = ", ".join(stage["module_fqns"]) or "-"
        sources.append(f"# ---- stage {stage['index']} ({modules})\n{source}")
    globals_used = set(code.globals)
    functions = ", ".join(f"{s['index']}: {s['function']}" for s in rank_stages)
    if getattr(graph, "loss", None) is not None and any(s["index"] == len(manifest["stages"]) - 1
                                                         for s in rank_stages):
        source, names = loss_source(graph.loss, model_path, graph.symbol_aliases)  # --cp: the rewritten loss_fn
        sources.append("# ---- the loss (the model file's loss_fn, traced: a mean over tokens is a sum and a count "
                       "over the cp ranks)\n" + source)
        globals_used |= names
        functions += ', "loss": loss_forward'
    prelude = globals_prelude(globals_used)
    return "\n".join([
        _header(manifest, rank, rank_stages),
        "import os",
        "",
        "import torch",
        prelude,
        f"from {RUNTIME_PACKAGE}.launch import main",
        "",
        "",
        "\n\n\n".join(sources),
        "",
        "",
        f"STAGE_FUNCTIONS = {{{functions}}}",
        "# the repeated blocks each stage calls (activation checkpointing recomputes them one by one)",
        f"STAGE_BLOCKS = {code.calls!r}",
        "",
        "",
        _shapes_function(manifest, rank_stages),
        "",
        "",
        "# This rank's actions for one step, in order: F forward, B backward (I input-grad, W weight-grad),",
        "# SEND/RECV of activations (_F) or gradients (_B) with the peer stage after '>' or '<'.",
        _actions_literal(manifest["plan"]["actions"][str(rank)]),
        "",
        "# Release points: after the action at position P of ACTIONS (0-based), wait on the sends at the listed",
        "# positions (their receives are provably posted by then, so the wait is short and the tensor freed); any",
        "# other send is waited on at the end of the step. Deleting RELEASES is safe.",
        _releases_literal(manifest["plan"]["actions"][str(rank)], manifest["plan"]["releases"][str(rank)]),
        "",
        'if __name__ == "__main__":',
        f"    main({rank}, STAGE_FUNCTIONS, ACTIONS, os.path.dirname(os.path.abspath(__file__)), "
        f"shapes=boundary_shapes,",
        '         releases=globals().get("RELEASES"))  # None once RELEASES is deleted',
        "",
    ]).replace("\n\n\n\n", "\n\n\n")


def _shapes_function(manifest: dict, rank_stages: list) -> str:
    """``boundary_shapes(**symbols)``: the shape of every tensor this rank receives (``<value>_from_stage<k>``,
    and the gradients coming back ``grad_<value>_from_stage<k>``) and every size its stages read, as plain
    Python over the step's root symbols. The runtime calls it once per microbatch."""
    symbols = sorted(manifest["symbols"])
    params = ", ".join(symbols) if symbols else ""
    mine = {s["index"] for s in rank_stages}
    stage_to_rank = manifest["plan"]["stage_to_rank"]

    def entry(key: str, shape: list) -> str:
        dims = ", ".join(str(d) for d in shape)
        return f'        "{key}": ({dims}{"," if len(shape) == 1 else ""}),'

    entries = []
    for stage in rank_stages:
        for item in stage["received"]:
            if item["producer"] in mine:
                continue  # handed over in memory, never received
            entries.append(entry(activation_key(item["name"], item["producer"]), item["shape"]))
        for name in stage["outputs"]:  # gradients coming back for what this rank sends
            value = manifest["values"].get(name)
            if value is None or not value["requires_grad"]:
                continue
            for consumer in value["consumers"]:
                if stage_to_rank[consumer] != stage_to_rank[stage["index"]]:
                    entries.append(entry(gradient_key(name, consumer), value["shape"]))
        for item in stage.get("sym_inputs", []):
            entries.append(f'        "{item["name"]}": {item["expr"]},')
    doc = ("    \"\"\"Shapes of the tensors this rank receives (activations in, gradients back) and the sizes its\n"
           "    stages read, from the step's root symbols: no shape is ever exchanged at run time.\"\"\"")
    lines = [f"def boundary_shapes({params}):" if not symbols else f"def boundary_shapes(*, {params}):", doc,
             "    return {"] + entries + ["    }"]
    return "\n".join(lines)


RUN_PY = '''"""Entry point of this tracepp pipeline: {launch_command}   (from this folder)

torchrun starts one process per rank; each runs rank<RANK>.py. Options (the same for every rank):
  --steps K        training steps (default 3)        --lr LR        SGD learning rate (default 0.01)
  --save PATH      write the trained state_dict       --metrics PATH one JSON line per step
  --timeout S      fail instead of waiting longer than S seconds for a peer (default 120)
  --precision fp32|bf16|fp16|fp8   compute dtype (default: the split's; fp32 master weights; fp16, fp8 on GPU)
  --clip-grad-norm MAX         clip the global gradient norm    --on-nonfinite stop|skip|continue
  --compile        torch.compile each stage (cache in compile_cache/, or --compile-cache DIR)
  --data F.bin --eval-data V.bin --eval-every N   token files   --tensorboard DIR   logs
  --checkpoint-dir D --save-every N --resume auto --keep-last K   a job that survives restarts
python run.py --nproc-per-node N [torchrun options] -- [options above]: the same, this file as the launcher.
Every option: python run.py --help. Your own loop: tracepp_runtime.Pipeline(this folder).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from {runtime}.launch import launch  # noqa: E402

if __name__ == "__main__":
    launch(HERE)
'''


def _previous_files(out_dir: str) -> list:
    """The files an earlier ``tracepp split`` wrote into ``out_dir`` (listed in its manifest), or None when the
    folder is not a tracepp output. Anything else in the folder (e.g. ``trained.pt``) is the user's."""
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        old = json.load(handle)
    if "files" in old:
        return list(old["files"]) + ["manifest.json"]
    # a manifest from before the file list: the same names this emit writes, derived from its plan
    files = ["run.py", "model_file.py", "manifest.json", os.path.join("weights", "unused.pt")]
    files += [f"rank{rank}.py" for rank in range(old["plan"]["num_ranks"])]
    files += [stage["weights"] for stage in old["stages"] if "weights" in stage]
    runtime_dir = os.path.join(out_dir, RUNTIME_PACKAGE)
    if os.path.isdir(runtime_dir):
        files += [os.path.join(RUNTIME_PACKAGE, name) for name in os.listdir(runtime_dir) if name.endswith(".py")]
    return files


def _remove_previous(out_dir: str, files: list) -> None:
    """Delete only the files an earlier run of ours wrote (so no stale rank3.py outlives a 2-rank re-plan),
    then the folders they leave empty; never anything else."""
    for name in files:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    for folder in ("weights", RUNTIME_PACKAGE):
        path = os.path.join(out_dir, folder)
        cache = os.path.join(path, "__pycache__")
        if os.path.isdir(cache) and all(n.endswith(".pyc") for n in os.listdir(cache)):
            shutil.rmtree(cache)  # byte code Python made from our own runtime copy
        if os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)


def _token_input(traced, graph):
    """The root input ``run.py --data`` fills with windows of token ids: the model's one batched input, a 2-D
    integer tensor (batch, sequence) at its traced shape, with the vocabulary of the embedding that reads it
    (None if no ``aten.embedding`` does); None when the model's batched inputs are anything else."""
    batched = [(name, ref) for name, ref in graph.root_inputs.items() if ref.batched]
    if len(batched) != 1 or batched[0][1].meta is None or traced.batch_dim != 0:  # windows are [batch, seq]
        return None
    name, ref = batched[0]
    leaf = traced.example_leaves[ref.leaf_index]
    if not isinstance(leaf, torch.Tensor) or leaf.dim() != 2 or leaf.dtype.is_floating_point or \
            leaf.dtype.is_complex or leaf.dtype == torch.bool:
        return None
    vocab = None
    for stage in graph.stages:
        for node in stage.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.embedding.default and \
                    getattr(node.args[1], "name", None) == name:
                weight = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
                vocab = int(weight.shape[0]) if weight is not None else None
    return {"leaf_index": ref.leaf_index, "path": ref.path, "batch": int(leaf.shape[0]), "seq": int(leaf.shape[1]),
            "vocab": vocab}


def emit(out_dir: str, model_file, traced, graph, plan: dict, launch_command: str, options=None) -> dict:
    """Write the folder. A folder an earlier split wrote is refreshed file by file (only the files its
    manifest lists are replaced or removed; e.g. ``trained.pt`` saved there stays); any other non-empty
    folder is refused."""
    manifest = build_manifest(model_file, traced, graph, plan, launch_command, options)
    previous = _previous_files(out_dir)
    if previous is None and os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"output folder {out_dir!r} exists, is not empty and has no tracepp manifest.json; "
                              f"choose another -o (tracepp only replaces folders it wrote itself)")
    if previous is not None:
        _remove_previous(out_dir, previous)
    written = []

    def target(name: str) -> str:
        written.append(name)
        return os.path.join(out_dir, name)

    os.makedirs(out_dir, exist_ok=True)
    created = _traced_constants(traced, manifest)
    if created:
        torch.save(created, target("constants.pt"))
    for rank, script in enumerate(rank_scripts(manifest, graph, model_file.path)):
        with open(target(f"rank{rank}.py"), "w") as handle:
            handle.write(script)
    with open(target("run.py"), "w") as handle:
        handle.write(RUN_PY.format(launch_command=launch_command, runtime=RUNTIME_PACKAGE))
    shutil.copyfile(model_file.path, target("model_file.py"))
    runtime_src = os.path.dirname(os.path.abspath(__import__("tracepp.runtime", fromlist=["x"]).__file__))
    os.makedirs(os.path.join(out_dir, RUNTIME_PACKAGE), exist_ok=True)
    for name in sorted(os.listdir(runtime_src)):
        if name.endswith(".py"):
            shutil.copyfile(os.path.join(runtime_src, name), target(os.path.join(RUNTIME_PACKAGE, name)))
    manifest["files"] = written  # what a later split into this folder may replace; manifest.json itself too
    record = dict(manifest, plan={k: v for k, v in manifest["plan"].items() if k != "releases"})  # in the scripts
    with open(os.path.join(out_dir, "manifest.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    return manifest
