"""The whole of ``tracepp split``, top to bottom: trace → split → plan → emit.

Each step is one module with one job and hands plain data to the next.
"""
from __future__ import annotations

import os
import shlex
from typing import Optional

import torch

from tracepp.codegen.emit import build_manifest, emit
from tracepp.codegen.memory import plan_memory
from tracepp.codegen.plan import build_plan, topology_of
from tracepp.codegen.schedules import stages_per_rank
from tracepp import phases
from tracepp.modelfile import load_model_file
from tracepp.resplit import split_options
from tracepp.runtime.mesh import Layout
from tracepp.runtime.run_options import RunOptions
from tracepp.split import context_parallel, expert_parallel, tensor_parallel, token_mean
from tracepp.split import verify as tp_verify
from tracepp.split import verify_cp as cp_verify
from tracepp.split import verify_ep as ep_verify
from tracepp.split.cost import per_rank_estimate
from tracepp.split.partition import split
from tracepp.trace import trace
from tracepp.trace_loss import trace_loss


def _plan(model_path: str, layout: Layout, num_stages: Optional[int], schedule: str, num_microbatches: int,
          split_points: Optional[list], dynamic_shapes, run: RunOptions = RunOptions(), all_modes: bool = False,
          verify: str = "on"):
    """Steps 1-3, shared by ``split`` and ``check``: (model file, traced program, stage graphs, plan). ``verify``:
    on (a tp plan that does not compute what the model does is repaired; a cp or ep plan refused), strict
    (refused), off (not run)."""
    if verify not in tp_verify.MODES:
        raise ValueError(f"--verify {verify!r}: use one of {', '.join(tp_verify.MODES)}")
    layout.check()
    run.check()
    model_file, traced, graph = trace_and_split(model_path, layout, num_stages, schedule, num_microbatches,
                                                split_points, dynamic_shapes, run.traced_dtype())
    loss = None
    if model_file.training and num_microbatches * layout.dp > 1:                     # 2'. a loss over some tokens
        with phases.step("token mean"):
            loss = _traced_loss(model_file, graph, traced, required=layout.cp > 1)
            graph.token_mean, warning = token_mean.find(loss, graph)
            if warning:
                traced.warnings.append(warning)
            elif graph.token_mean:
                traced.notes.append(f"the loss is a mean over the tokens its target does not ignore "
                                    f"({graph.token_mean['op']}, ignore_index {graph.token_mean['ignore_index']}): "
                                    f"each microbatch is weighed by its share of the batch's counted tokens, as "
                                    f"eager's one mean over the batch weighs them")
    if layout.cp > 1:                                                                 # 2a. context parallel
        with phases.step("cp plan"):
            if loss is None and model_file.training:
                loss = trace_loss(model_file, graph)
            saved = None
            if verify != "off":
                with phases.step("verify snapshot"):  # the stage graphs and the loss before the rewrite
                    saved = cp_verify.snapshot(graph, loss)

            def replan(forced=frozenset()):  # (an op verification found placed wrong runs on the whole sequence)
                if forced:
                    cp_verify.restore(graph, saved, loss)
                planned = context_parallel.plan(graph, layout.cp, loss, model_file.training,
                                                whole=verify != "strict", forced=forced)
                context_parallel.apply(graph, *planned[:2], loss, planned[2])
                return planned

            cp_plan, walks, loss_walk = replan()
        if verify != "off":                                                           # 2a'. the plan verified
            with phases.step("cp verify"):
                target = _microbatch_target(model_file, traced, layout) if model_file.training else None
                cp_plan, walks, loss_walk, record, notes = cp_verify.check(
                    graph, saved, cp_plan, walks, loss, loss_walk, traced, target, verify, model_file.training,
                    layout.tp, replan)
                traced.notes.extend(notes)
        graph.context_parallel, graph.loss = cp_plan.to_json(), loss
        if context_parallel.whole_note(cp_plan):
            traced.notes.append(context_parallel.whole_note(cp_plan))
        if verify != "off":
            graph.context_parallel["verified"] = record
    if layout.tp > 1:                                                                 # 2b. tensor parallel
        saved = None
        if verify != "off":
            with phases.step("verify snapshot"):  # the stage graphs before the rewrite (verification's reference)
                saved = tp_verify.snapshot(graph)
        with phases.step("tp plan"):
            tp_plan, walks = tensor_parallel.plan(graph, layout.tp, model_file.tp_plan, layout.sequence_parallel)
            tensor_parallel.apply(graph, tp_plan, walks)
        if verify != "off":                                                           # 2b'. the plan verified
            with phases.step("verify"):
                tp_plan, record = _verify_tp(graph, saved, tp_plan, walks, traced, model_file, layout, verify)
        graph.tensor_parallel = tp_plan.to_json()
        if verify != "off":
            graph.tensor_parallel["verified"] = record
    with phases.step("ep plan"):
        ep_plan, blocks = expert_parallel.plan(graph, layout.ep, layout.dp, tensor_parallel.fqn_map)  # 2c. experts
        check_ep = verify != "off" and layout.ep > 1 and bool(ep_plan.blocks)
        if check_ep:
            with phases.step("verify snapshot"):  # the stage graphs before the rewrite (verification's reference)
                saved = ep_verify.snapshot(graph)
        if ep_plan.blocks:
            expert_parallel.apply(graph, ep_plan, blocks)
            graph.expert_parallel = ep_plan.to_json()
        if layout.world_size > layout.pp:  # what each rank holds of its stages: tp pieces, experts, FSDP shards
            for stage in graph.stages:
                stage.estimate = per_rank_estimate(stage, graph, layout.data_parallel(), model_file.training)
    if check_ep:                                                                      # 2c'. the plan verified
        with phases.step("ep verify"):
            record, notes = ep_verify.check(graph, saved, ep_plan, blocks, traced, layout,
                                            (graph.tensor_parallel or {}).get("params"), verify, model_file.training)
            traced.notes.extend(notes)
        graph.expert_parallel["verified"] = record
    with phases.step("schedule"):
        the_plan = build_plan(schedule, layout.pp, graph.num_stages, num_microbatches,    # 3. schedule
                              topology_of(graph), model_file.training).to_json()
        if layout.dp * layout.cp > 1:  # FSDP/DDP wrap the stages (over dp x cp with context parallelism)
            _check_shared_on_one_rank(graph, the_plan, schedule, layout)
        if layout.world_size > layout.pp:
            the_plan["mesh"] = layout.to_json()
    with phases.step("memory"):
        graph.memory, run = memory_plan(model_file, traced, graph, the_plan, layout, run,   # 3b. memory per rank
                                        all_modes)
    return model_file, traced, graph, the_plan, run


def _traced_loss(model_file, graph, traced, required: bool):
    """The model file's ``loss_fn`` traced (``trace_loss``); where only the token count asks for it (no --cp), a
    loss that does not trace is None, its microbatches weighed by their samples, which a note says."""
    try:
        return trace_loss(model_file, graph)
    except Exception as error:  # noqa: BLE001 - the user's loss function: --cp says what broke, as it did
        if required:
            raise
        traced.notes.append(f"loss_fn was not traced ({type(error).__name__}: {str(error)[:200]}), so tracepp did not "
                            f"check whether it is a mean over the tokens its target does not ignore: its microbatches "
                            f"are weighed by their samples, which is eager's loss unless such a mean meets padding "
                            f"spread unevenly over them (docs/guide.md, 'A loss over some tokens')")
        return None


def _verify_tp(graph, saved, tp_plan, walks, traced, model_file, layout: Layout, mode: str) -> tuple:
    """Step 2b': the applied tp plan run for every tp rank against the stage graphs before the rewrite
    (``split.verify``); a mismatch repaired (the parameters feeding it made whole, planned again) or refused
    (``strict``). Returns (the plan, its record for the manifest); what was repaired becomes a note."""
    def replan(extra: dict) -> tuple:
        tp_verify.restore(graph, saved)
        overrides = dict(model_file.tp_plan or {}, **extra)
        new_plan, new_walks = tensor_parallel.plan(graph, layout.tp, overrides, layout.sequence_parallel)
        tensor_parallel.apply(graph, new_plan, new_walks)
        return new_plan, new_walks

    tp_plan, _walks, record, notes = tp_verify.verify_and_repair(graph, saved, tp_plan, walks, traced, replan, mode,
                                                                  model_file.training, layout.cp)
    if layout.cp > 1:  # the reference is the cp-rewritten stages (verified against the model's: cp.verified)
        record["scope"] = (f"tp's rewrite of the cp-rewritten stages, every (tp, cp) rank pair against the {layout.cp} "
                           f"cp ranks' run of those stages; with cp.verified, tp x cp against the unsharded stages")
    traced.notes.extend(notes)
    return tp_plan, record


def trace_and_split(model_path: str, layout: Layout, num_stages: Optional[int], schedule: str,
                    num_microbatches: int, split_points: Optional[list], dynamic_shapes, param_dtype=None) -> tuple:
    """Steps 1-2: (model file, traced program, stage graphs) before any parallel plan. ``param_dtype``: trace with
    the parameters (and floating inputs) cast to it (``--mixed-precision params``; ``trace.trace``)."""
    with phases.step("load"):
        model_file = load_model_file(model_path)                                      # the user's contract
    with phases.step("trace"):
        if layout.dp > 1:  # each replica runs the pipeline on its slice: trace a microbatch of the replica's batch
            traced = _trace_replica(model_file, num_microbatches, dynamic_shapes, layout, param_dtype)
        else:
            traced = trace(model_file, num_microbatches, dynamic_shapes, on_meta="auto",  # 1. torch.export
                           param_dtype=param_dtype)
    points = None if split_points == "auto" else (split_points or model_file.split_points)
    with phases.step("split"):
        graph = split(traced, points, num_stages,                                     # 2. stage graphs
                      default_stages=layout.pp * stages_per_rank(schedule), schedule=schedule,
                      num_microbatches=num_microbatches, training=model_file.training)
    return model_file, traced, graph


def split_model(model_path: str, out_dir: str, num_stages: Optional[int] = None, schedule: str = "1f1b",
                num_microbatches: int = 4, split_points: Optional[list] = None, dynamic_shapes=None,
                layout: Layout = Layout(pp=2), run: RunOptions = RunOptions(), verify: str = "on") -> dict:
    """``tracepp split``: the folder ``out_dir`` for ``layout`` (pipeline ranks, data, tensor and expert
    parallelism: one value) and ``run`` (the precision, activation checkpointing and optimizer its memory is
    planned for, and run.py defaults to); returns its manifest."""
    model_file, traced, graph, the_plan, planned = _plan(model_path, layout, num_stages, schedule,
                                                         num_microbatches, split_points, dynamic_shapes, run,
                                                         verify=verify)
    options = split_options(model_path, layout, num_stages, schedule, num_microbatches, split_points,
                            dynamic_shapes, graph, run)
    options["run_options"], options["requested_run_options"] = planned.to_json(), run.to_json()
    with phases.step("emit"):
        manifest = emit(out_dir, model_file, traced, graph, the_plan, launch_command(layout.world_size),  # 4. output
                        options)
    return manifest


def _check_shared_on_one_rank(graph, the_plan: dict, schedule: str, layout: Layout) -> None:
    """FSDP and DDP wrap each stage as one unit: a parameter two stages of one rank share (a tied embedding and
    head on a V placement's first rank) cannot belong to two of them."""
    to_rank = the_plan["stage_to_rank"]
    for ref in graph.shared_state():
        ranks = [to_rank[s] for s in ref.stages]
        same = sorted({r for r in ranks if ranks.count(r) > 1})
        if same:
            stages = [s for s in ref.stages if to_rank[s] == same[0]]
            what = f"--dp {layout.dp}" if layout.cp == 1 else f"--cp {layout.cp} (FSDP/DDP over dp x cp)"
            raise ValueError(f"{what} with schedule {schedule!r} puts stages {stages[0]} and {stages[1]}, "
                             f"which share {' = '.join(ref.aliases)}, on rank {same[0]}: {layout.dp_mode} wraps each "
                             f"stage as one unit and cannot hold one parameter twice. Use a schedule that places "
                             f"them on different ranks (interleaved-zb, interleaved-1f1b, 1f1b), or untie the "
                             f"weight")


def launch_command(world_size: int, folder: Optional[str] = None) -> str:
    """``torchrun --nproc-per-node N run.py``, run in the output folder (what the manifest and the scripts say,
    true wherever the folder is copied), or with ``folder`` the path to its ``run.py`` (the CLI's hint)."""
    script = "run.py" if folder is None else shlex.quote(os.path.join(folder, "run.py"))
    return f"torchrun --nproc-per-node {world_size} {script}"


def check_model(model_path: str, num_stages: Optional[int] = None, schedule: str = "1f1b",
                num_microbatches: int = 4, split_points: Optional[list] = None, dynamic_shapes=None,
                layout: Layout = Layout(pp=2), run: RunOptions = RunOptions(), verify: str = "on") -> dict:
    """``tracepp check``: trace, split and plan as :func:`split_model` does, and return the manifest unwritten."""
    model_file, traced, graph, the_plan, planned = _plan(model_path, layout, num_stages, schedule,
                                                         num_microbatches, split_points, dynamic_shapes, run,
                                                         verify=verify)
    return build_manifest(model_file, traced, graph, the_plan, launch_command(layout.world_size),
                          {"run_options": planned.to_json()})


def memory_plan(model_file, traced, graph, the_plan: dict, layout: Layout, run: RunOptions,
                all_modes: bool = False) -> dict:
    """Step 3b: what each stage keeps and each rank's peak (``codegen.memory``) for the run options: the precision,
    each stage's activation checkpointing (``in-flight`` resolved from the plan) and the optimizer run.py builds
    (the model file's ``optimizer(params)``, else ``--optimizer``)."""
    from tracepp.codegen.memory import MemoryOptions
    from tracepp.runtime import recompute
    from tracepp.runtime.actions import Action
    from tracepp.runtime.optim import build_optimizer

    actions = the_plan["actions"]
    modes = None if run.activation_checkpointing == "auto" else recompute.stage_modes(
        run.activation_checkpointing, graph.num_stages,
        lambda s: [str(a) for a in actions[the_plan["stage_to_rank"][s]]])
    split_backward = any(Action.parse(str(a)).kind in ("I", "W") for rank in actions.values() for a in rank)
    options = MemoryOptions(precision=run.precision, mixed_precision=run.mixed_precision,
                            fp8_recipe=run.fp8_recipe, recompute=modes, split_backward=split_backward,
                            tp=layout.tp, ep=layout.ep, expert_imbalance=run.expert_imbalance, device=run.device,
                            cp=layout.cp)
    target = _microbatch_target(model_file, traced, layout) if model_file.training else None
    loss_fn = getattr(model_file.module, "loss_fn", None)
    if graph.loss is not None:  # --cp: the loss as the last rank runs it (a sum and a count over the cp ranks)
        loss_fn = context_parallel.loss_callable(graph.loss)

    def make_optimizer(named):
        return build_optimizer(model_file.module, named, name=run.optimizer or "sgd")

    memory = plan_memory(graph, traced.model, the_plan, layout.data_parallel(), options, loss_fn, target,
                         make_optimizer, model_file.training, run.memory_limit, all_modes)
    chosen = memory.get("checkpointing")
    if chosen is not None:  # --activation-checkpointing auto: what run.py applies is the choice
        modes = chosen["modes"]
        run = run.replace(activation_checkpointing=modes[0] if len(set(modes)) == 1 else ",".join(modes))
    bound = [index for index, entry in enumerate(memory.get("ranks") or []) if entry.get("bound")]
    if bound and run.memory_limit is not None:
        from tracepp.runtime.memory_fit import size_text

        memory["notes"].append(
            f"--memory-limit {size_text(run.memory_limit)} decided on a bound for pipeline rank "
            f"{', '.join(map(str, bound))}: a stage there could not be counted on fake tensors (see its note), so its "
            f"peak is the split's upper bound; the checkpointing "
            f"{'chosen' if chosen is not None else 'given'} may recompute more than the job needs")
    check_fits(memory, run, auto=chosen is not None)
    return memory, run


def check_fits(memory: dict, run: RunOptions, auto: bool = False) -> None:
    """With ``--memory-limit``: refuse a plan whose peak on some rank is over it, naming the ranks, their peaks
    and parts, and what would fit (``auto``: the checkpointing was chosen by ``--activation-checkpointing auto``)."""
    limit = run.memory_limit
    ranks = memory.get("ranks") or []
    over = [(rank, entry) for rank, entry in enumerate(ranks) if entry["peak_bytes"] > (limit or float("inf"))]
    if not over:
        return
    from tracepp.runtime.memory_fit import size_text as size

    rank, entry = max(over, key=lambda item: item[1]["peak_bytes"])
    parts = ", ".join(f"{name} {size(value)}" for name, value in entry["parts"].items() if value)
    alternatives = memory.get("alternatives") or {}
    fits = [mode for mode, peaks in alternatives.items() if max(peaks) <= limit]
    state = sum(entry["parts"].get(name, 0) for name in ("parameters", "gradients", "optimizer"))
    least = f" (full: {size(max(alternatives['full']))} at most)" if alternatives.get("full") else ""
    if fits and not auto:
        advice = f"--activation-checkpointing {' or '.join(fits)} fits (auto chooses per stage)"
    else:  # auto took full where it had to; no checkpointing makes it fit
        advice = (f"no activation checkpointing fits, not even full on every stage{least}; this rank's parameters, "
                  f"gradients and optimizer state alone are {size(state)}")
    bound = (f", a bound: stage {', '.join(map(str, entry.get('bound_stages') or []))} could not be counted on fake "
             f"tensors, so this decides on the split's upper bound" if entry.get("bound") else "")
    raise ValueError(f"--memory-limit {size(limit)}: {len(over)} of {len(ranks)} pipeline ranks do not fit; rank "
                     f"{rank} peaks at {size(entry['peak_bytes'])} ({entry.get('at')}: {parts}{bound}). {advice}; "
                     f"more pipeline ranks (--ranks), a larger --tp or --ep, or FSDP over more --dp ranks hold less per "
                     f"rank (`tracepp inspect` after a split without the limit shows the parts)")


def _microbatch_target(model_file, traced, layout: Layout):
    """The target of one traced microbatch (its shape and dtype are what the last stage's loss sees)."""
    import torch.utils._pytree as pytree

    target = model_file.example_target()
    global_batch, dim = traced.batch_size * layout.dp, traced.batch_dim
    size = -(-global_batch // (traced.num_microbatches * layout.dp))
    return pytree.tree_map_only(torch.Tensor, lambda t: t.narrow(dim, 0, size)
                                if t.dim() > dim and t.shape[dim] == global_batch else t, target)


def _trace_replica(model_file, num_microbatches: int, dynamic_shapes, layout: Layout, param_dtype=None):
    """Trace with the microbatch a replica runs (global batch / dp / microbatches); the manifest's batch size
    is then the replica's."""
    import dataclasses

    import torch.utils._pytree as pytree

    from tracepp.trace import batch_size_of

    leaves, _spec = pytree.tree_flatten((tuple(model_file.example_inputs()), dict(model_file.example_kwargs())))
    global_batch = batch_size_of(leaves, f"{model_file.path}: example_inputs()", model_file.batch_dim)
    layout.check_batch(global_batch)
    per_replica = global_batch // layout.dp
    if num_microbatches > per_replica:
        raise ValueError(f"--microbatches {num_microbatches} does not fit a replica's {per_replica} samples "
                         f"(global batch {global_batch} / --dp {layout.dp}): choose 1..{per_replica}")
    traced = trace(model_file, num_microbatches * layout.dp, dynamic_shapes, on_meta="auto", param_dtype=param_dtype)
    return dataclasses.replace(traced, num_microbatches=num_microbatches, batch_size=per_replica)
