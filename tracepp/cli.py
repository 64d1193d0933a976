"""The ``tracepp`` command line: ``split`` a model file into a runnable pipeline, ``inspect`` or ``plan`` it.

    tracepp split model.py -o out/ [--ranks R] [--stages N] [--schedule NAME|file.csv] [--microbatches M]
                                   [--split-points a,b] [--dynamic NAME:DIM=SYMBOL ...] [--bundle PKG ...]
                                   [--dp N] [--dp-mode fsdp|ddp|hsdp] [--dp-shard K] [--dp-order pp-inner|dp-inner]
    tracepp check model.py [split options]      # trace, split, plan; print the stage table and warnings
    tracepp inspect out/
    tracepp plan out/ [--svg plan.svg] [--trace plan.json] [--costs measured.json] [--calibrate]
                      [--tune [--memory-limit 20GB] [--top K] [--measure K] [--apply]]
    tracepp calibrate out/ [--costs COSTS.json ...] [--comm COMM.json | --nproc N] [--fit-steps K | --no-fit]
                      [--repeats R] [--no-runtime] [--overhead busy|delay|scale] [--paired-steps P]
"""
from __future__ import annotations

import argparse
import os
import sys


def _split(args) -> int:
    from tracepp.driver import launch_command, split_model
    from tracepp.dynamic import parse_flags

    if args.dry_run:
        return _check(args)
    _check_layout(args)
    points = _split_points(args.split_points)
    manifest = split_model(args.model, args.out, num_stages=args.stages, schedule=args.schedule,
                           num_microbatches=args.microbatches, split_points=points,
                           dynamic_shapes=parse_flags(args.dynamic) if args.dynamic else None, layout=_layout(args),
                           run=_run_options(args), verify=args.verify)
    from tracepp.modelfile import bundle_packages
    from tracepp.runtime.mesh import describe
    from tracepp.report.stages import stage_table

    bundled = bundle_packages(args.out, args.bundle, manifest["import_paths"]) if args.bundle else []
    _print_notes(manifest)
    print(stage_table(manifest))
    for line in describe(manifest["plan"]):
        print(line)
    print(f"\nwrote {args.out}: manifest.json, run.py, "
          f"{', '.join(f'rank{r}.py' for r in range(manifest['plan']['num_ranks']))}, tracepp_runtime/"
          + "".join(f", {os.path.basename(path)}" for path in bundled)
          + " (no weights: each rank loads its own with --load CKPT or builds them from model())")
    print(f"run it: {launch_command(_world(manifest['plan']), args.out)} --steps 3")
    return 0


def _print_notes(manifest: dict) -> None:
    """What tracing noticed (stdout), and each op the FLOP count saw no formula for (one warning line each)."""
    for note in manifest.get("notes", []):
        print(f"note: {note}")
    for warning in manifest.get("warnings", []):  # what makes a pipelined run differ from eager (a batch that mixes)
        print(f"warning: {warning}", file=sys.stderr)
    for warning in manifest.get("flop_count", {}).get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    for warning in (manifest.get("memory") or {}).get("notes") or []:  # a rank's peak that is a bound, not a count
        print(f"warning: memory: {warning}", file=sys.stderr)


def _world(plan: dict) -> int:
    """The processes a plan runs on: its ranks times its data-parallel replicas times its tensor-parallel ranks."""
    from tracepp.runtime.mesh import mesh_layout, world_size

    return world_size(mesh_layout(plan))


def _check(args) -> int:
    """Trace, split and plan; print the stage table and the warnings; write nothing."""
    from tracepp.report.checks import stage_warnings
    from tracepp.driver import check_model
    from tracepp.dynamic import parse_flags
    from tracepp.report.stages import (estimate_table, expert_parallel_table, memory_table, stage_table,
                                       tensor_parallel_table)

    _check_layout(args)
    points = _split_points(args.split_points)
    manifest = check_model(args.model, num_stages=args.stages, schedule=args.schedule,
                           num_microbatches=args.microbatches, split_points=points,
                           dynamic_shapes=parse_flags(args.dynamic) if args.dynamic else None, layout=_layout(args),
                           run=_run_options(args), verify=args.verify)
    _print_notes(manifest)
    print(stage_table(manifest))
    from tracepp.report.context_parallel import context_parallel_table

    for table in (estimate_table(manifest) if manifest["plan"].get("mesh") else "", memory_table(manifest),
                  tensor_parallel_table(manifest), expert_parallel_table(manifest), context_parallel_table(manifest)):
        if table:
            print()
            print(table)
    warnings = stage_warnings(manifest)
    print()
    for warning in warnings:
        print(f"warning: {warning}")
    warnings += manifest.get("warnings", [])  # printed with the notes, above
    print(f"{len(warnings)} warning(s); nothing written. `tracepp split` with the same options writes the folder.")
    return 0


def _check_layout(args) -> None:
    """Reject impossible rank/stage/schedule combinations before tracing (which takes a while)."""
    if args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks}: need at least 1 rank")
    if args.microbatches < 1:
        raise ValueError(f"--microbatches {args.microbatches}: need at least 1 microbatch")
    from tracepp.codegen.schedules import SCHEDULES, check_stages_divide, is_csv, placement

    _layout(args).check()
    _run_options(args).check(args.stages)
    if args.stages is None:
        return
    if args.stages < 1:
        raise ValueError(f"--stages {args.stages}: need at least 1 stage")
    if is_csv(args.schedule):
        check_stages_divide(args.stages, args.ranks)
    elif args.schedule in SCHEDULES:  # an unknown name is reported by the planner with the list of valid ones
        placement(args.schedule, args.ranks, args.stages)


def _inspect(args) -> int:
    from tracepp.codegen.manifest import load_manifest
    from tracepp.report.plan import plan_report
    from tracepp.runtime.mesh import describe
    from tracepp.report.stages import (boundary_table, estimate_table, expert_parallel_table, inspect_json,
                                       memory_table, stage_table, tensor_parallel_table)

    manifest = load_manifest(args.out)
    if args.json:
        import json

        print(json.dumps(inspect_json(manifest), indent=1))
        return 0
    print(stage_table(manifest))
    from tracepp.report.context_parallel import context_parallel_table

    for section in (estimate_table(manifest), memory_table(manifest), boundary_table(manifest),
                    tensor_parallel_table(manifest), expert_parallel_table(manifest), context_parallel_table(manifest)):
        if section:
            print()
            print(section)
    print()
    print(plan_report(manifest, grid=args.grid))
    for line in describe(manifest["plan"]):  # data parallel: which global ranks replicate which pipeline rank
        print(line)
    return 0


def _plan(args) -> int:
    from tracepp.costs.costs_file import load_costs
    from tracepp.codegen.manifest import load_manifest
    from tracepp.report.plan import plan_report, write_plan_pictures

    if args.calibrate:
        _calibrate(args)
    manifest = load_manifest(args.out)
    if args.tune or args.apply or args.measure:
        return _tune(args, manifest)
    costs = load_costs(args.costs, len(manifest["stages"])) if args.costs else None
    print(plan_report(manifest, grid=True, costs=costs))
    calibration = _calibration_if_any(args)
    if calibration is not None:
        from tracepp.costs.model import predict_folder

        try:
            prediction = predict_folder(manifest, calibration)
        except ValueError as error:
            print(f"calibrated prediction: not available ({error})")
        else:
            noise = calibration.noise_fraction()
            print(f"calibrated prediction ({args.calibration or 'OUT/calibration.json'}: measured comms, stage costs "
                  f"and runtime overheads): step {prediction.step_s * 1000:.1f} ms"
                  + (f" (+/- {noise:.0%}: the machine's noise while calibrating)" if noise is not None else "")
                  + f", bubble {prediction.bubble:.1%}")
    for path in write_plan_pictures(manifest, args.svg, args.trace, costs=costs):
        print(f"wrote {path}")
    return 0


def _calibration_if_any(args, required: bool = False):
    from tracepp.costs.model import CALIBRATION_FILE, load_calibration

    path = args.calibration or os.path.join(args.out, CALIBRATION_FILE)
    if not required and not args.calibration and not os.path.isfile(path):
        return None
    return load_calibration(path)


def _tune(args, manifest) -> int:
    from tracepp.driver import launch_command
    from tracepp.costs.search import current_candidate, format_tuning, parse_bytes, tune
    from tracepp.resplit import apply_tuned

    calibration = _calibration_if_any(args, required=True)
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    schedules = [s.strip() for s in args.schedules.split(",")] if args.schedules else None
    counts = [int(m) for m in args.microbatch_counts.split(",")] if args.microbatch_counts else None
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")] if args.tp_sizes else None
    ep_sizes = [int(e) for e in args.ep_sizes.split(",")] if args.ep_sizes else None
    cp_sizes = [int(c) for c in args.cp_sizes.split(",")] if args.cp_sizes else None
    from tracepp.costs.search import ep_of_split
    from tracepp.tuner_figures import ensure

    ep_of_split(manifest, ep_sizes)  # a refusal the plan alone decides comes before any figure is computed
    manifest = ensure(manifest, args.out, tp_sizes, cp_sizes, ep_sizes, limit)  # computed when first asked for
    kept, dropped, failed = tune(manifest, calibration, memory_limit=limit, schedules=schedules,
                                 microbatch_counts=counts,
                                 optimizer_bytes_per_param=_optimizer_bytes(args, manifest),
                                 tp_sizes=tp_sizes, ep_sizes=ep_sizes, cp_sizes=cp_sizes)
    print(format_tuning(kept, dropped, failed, args.top, limit, current_candidate(kept, dropped, manifest)))
    noise = calibration.noise_fraction()
    if noise is not None and kept:
        print(f"predicted times are +/- {noise:.0%} (the machine's noise while calibrating): plans closer than that "
              f"are a tie")
    if not kept:
        raise ValueError("no candidate fits" + (f" --memory-limit {args.memory_limit}" if limit else "")
                         + ": raise the limit, or add ranks")
    best, rank = kept[0], 1
    if args.measure:
        best, rank = _measure(args, manifest, kept[:args.measure])
    if args.apply:
        print(f"applying #{rank}: --schedule {best.schedule} --stages {best.num_stages} --microbatches "
              f"{best.num_microbatches} --split-points {','.join(best.split_points)}"
              + (f" --tp {best.tp}" if best.tp > 1 else "")
              + (" --sequence-parallel" if best.sequence_parallel else "")
              + (f" --ep {best.ep}" if best.ep > 1 else "") + (f" --cp {best.cp}" if best.cp > 1 else "")
              + (f" --activation-checkpointing {best.checkpointing}" if best.checkpointing != "none" else ""))
        written = apply_tuned(manifest, args.out, best)
        if args.measure:
            _write_measured(args)  # the split wrote OUT afresh
        run = launch_command(_world(written["plan"]), args.out)
        print(f"wrote {args.out} ({written['plan']['schedule']}, {len(written['stages'])} stages, "
              f"{written['plan']['num_microbatches']} microbatches); run it: {run} --steps 3")
    return 0


def _optimizer_bytes(args, manifest) -> float:
    """--optimizer-bytes-per-param, else the state per parameter the split counted for its optimizer."""
    if args.optimizer_bytes_per_param is not None:
        return args.optimizer_bytes_per_param
    from tracepp.costs.search import ADAM_BYTES_PER_PARAM

    ranks = (manifest.get("memory") or {}).get("ranks") or []
    state = sum(r.get("optimizer", {}).get("state_bytes", 0) for r in ranks)
    numel = sum(r.get("optimizer", {}).get("numel", 0) for r in ranks)
    return state / numel if numel else ADAM_BYTES_PER_PARAM


def _measure(args, manifest, candidates: list) -> tuple:
    """``--measure K``: the plans split and run in paired rounds (``tracepp.costs.measure_plans``); prints
    measured beside predicted, writes OUT/tune_measured.json; (the fastest measured plan, its predicted rank)."""
    import tempfile

    from tracepp.costs.measure_plans import DEFAULT_WARMUP, fastest, format_measured, measure, summarize
    from tracepp.resplit import apply_tuned

    if args.measure < 1 or args.measure_steps < 1 or args.measure_rounds < 1:
        raise ValueError(f"--measure {args.measure} --measure-steps {args.measure_steps} --measure-rounds "
                         f"{args.measure_rounds}: each must be at least 1")

    def prepare(candidate, folder):
        return _world(apply_tuned(manifest, folder, candidate)["plan"])

    print(f"measuring the {len(candidates)} best predicted plan(s): {args.measure_rounds} round(s) of "
          f"{args.measure_steps} measured steps each, after {DEFAULT_WARMUP} warm-up steps")
    with tempfile.TemporaryDirectory(prefix="tracepp_measure_") as work:
        plans = measure(candidates, prepare, work, rounds=args.measure_rounds, steps=args.measure_steps,
                        interleave=args.measure_method == "auto")
    rows = summarize(plans)
    print(format_measured(rows))
    for row in rows:
        if row["error"]:
            print(f"plan #{row['predicted_rank']} did not run: {row['error']}")
    chosen = fastest(plans)
    if chosen is None:
        raise ValueError("none of the measured plans ran (see above): fix the error, or --apply without --measure")
    note = ("the best predicted plan is also the fastest measured" if chosen.predicted_rank == 1 else
            f"the fastest measured plan is #{chosen.predicted_rank} of the predicted order "
            f"({chosen.measured_s * 1000:.1f} ms against #1's "
            + (f"{plans[0].measured_s * 1000:.1f} ms)" if plans[0].measured_s else "failed run)"))
    print(note)
    args._measured_rows = rows  # written beside the plan after --apply (which splits OUT again)
    _write_measured(args)
    return chosen.candidate, chosen.predicted_rank


def _write_measured(args) -> None:
    import json

    path = os.path.join(args.out, "tune_measured.json")
    with open(path, "w") as handle:
        json.dump({"rounds": args.measure_rounds, "measured_steps": args.measure_steps, "plans": args._measured_rows},
                  handle, indent=1)
    print(f"wrote {path}")


def _calibrate(args) -> int:
    from tracepp.costs.calibrate import calibrate

    try:
        calibrate(args.out, costs_paths=args.costs_files or ([args.costs] if getattr(args, "costs", None) else None),
                  comm_path=args.comm, nproc=args.nproc, fit_steps=args.fit_steps, fit=not args.no_fit,
                  skip_comm=args.no_comm, mode=args.overhead, repeats=args.repeats, runtime=not args.no_runtime,
                  paired_steps=args.paired_steps)
    except RuntimeError as error:  # a launched run failed: say which and how
        raise ValueError(str(error)) from None
    return 0


def _add_split_options(parser) -> None:
    parser.add_argument("model", help="model file defining model() and example_inputs() (see docs/guide.md)")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks, i.e. torchrun processes (default 2)")
    parser.add_argument("--stages", type=int, default=None,
                        help="number of stages (default: from split points, else ranks x stages per rank)")
    from tracepp.codegen.schedules import SCHEDULES

    parser.add_argument("--schedule", default="1f1b", help=f"{', '.join(SCHEDULES)}, or a .csv")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (default 4)")
    parser.add_argument("--timings", nargs="?", const="-", default=None, metavar="FILE.json",
                        help="print where planning's time and memory went, per step (load, trace, split, cp/tp/ep "
                             "plans, schedule, memory, emit: wall s, CPU s, resident and peak GB) to stderr; with "
                             "FILE.json also write them there")
    parser.add_argument("--split-points", default=None,
                        help="comma-separated module FQNs where a new stage begins (overrides the model file's); "
                             "'auto' cuts between repeated blocks by the cost model even if the file lists points")
    parser.add_argument("--dynamic", action="append", default=None, metavar="INPUT:DIM=SYMBOL",
                        help="mark a dim of a named input dynamic, e.g. idx:1=seq (repeatable)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks per stage: shard each stage's matmuls over T processes, "
                             "planned from the traced graph (see docs/tensor-parallel.md); the job runs "
                             "ranks x dp x tp processes (default 1)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks: spread each stage's routed experts over E of its --dp ranks "
                             "(E divides dp and the expert count), with an all-to-all of the routed tokens; see "
                             "docs/expert-parallel.md (default 1)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: split the activations between tensor-parallel regions over the sequence "
                             "dim (norms, residual adds and dropout on the shards; all-gather into each column-"
                             "parallel region, reduce-scatter out of each row-parallel one), as Megatron-Core does: "
                             "each tp rank keeps and sends 1/tp of them")
    parser.add_argument("--verify", default="on", choices=["on", "strict", "off"],
                        help="with --tp, --cp or --ep: run each stage's rewritten program (with --cp the loss's too) "
                             "for every tp and cp rank, and every rank of one ep group (each its own microbatch), in "
                             "this process against the unsharded stage, forward and backward (float64), before "
                             "anything is written; on (default): a tp value that differs is made whole (the "
                             "parameters feeding it replicated) and the plan made again, a cp value that differs has "
                             "its op run on the whole sequence at every cp rank and the plan made again, an ep plan "
                             "that differs is refused (no repair); with --cp an op no rule places runs on the whole "
                             "sequence (named in the notes); strict: refuse instead, naming the op and line (and "
                             "refuse what --cp would run on the whole sequence); off: skip (see "
                             "docs/tensor-parallel.md, docs/context-parallel.md, docs/expert-parallel.md)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel ranks per stage: spread each sample's sequence over C processes "
                             "(2C chunks, rank r holding chunks r and 2C-1-r), keys and values all-gathered for "
                             "attention, read from the traced graph (see docs/context-parallel.md); the job runs "
                             "ranks x dp x cp x tp processes (default 1)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel replicas of the pipeline: the job runs ranks x dp processes (default 1)")
    parser.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "ddp", "hsdp"],
                        help="fully_shard each stage over dp (default), replicate it (DDP), or HSDP with --dp-shard")
    parser.add_argument("--dp-shard", type=int, default=None, metavar="K",
                        help="hsdp: shard over K ranks, replicate over dp / K")
    parser.add_argument("--dp-order", default="pp-inner", choices=["pp-inner", "dp-inner"],
                        help="pp-inner (default): consecutive global ranks form one pipeline; dp-inner: "
                             "consecutive ranks are replicas of one pipeline rank")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "fp8"],
                        help="the compute dtype the job will run in: memory is counted in it, and run.py defaults "
                             "to it; below fp32 the master weights, optimizer state and gradient reductions stay fp32 "
                             "(fp8: bf16 with torchao's float8 linears, GPU only; default fp32)")
    parser.add_argument("--mixed-precision", default="params", choices=["params", "autocast"],
                        help="how a precision below fp32 applies: params (default) traces and runs the model with its "
                             "parameters cast to the compute dtype once per step, as FSDP2's MixedPrecisionPolicy("
                             "param_dtype=bf16, reduce_dtype=fp32): bf16 gathered and computed, no per-op casts; "
                             "autocast keeps fp32 parameters and casts per op (torch.autocast), for a model that mixes "
                             "its weights' dtype with fp32 tensors it never casts or needs autocast's fp32 ops")
    parser.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"],
                        help="with --precision fp8: torchao's float8 scaling (tensorwise also all-gathers the weights "
                             "in float8 under FSDP; default tensorwise)")
    parser.add_argument("--activation-checkpointing", default="none", metavar="MODE",
                        help="none, full, selective (keep matmul, attention and collective outputs, recompute the "
                             "rest), in-flight (full where a stage holds several microbatches), one of "
                             "none/full/selective per stage, comma-separated, or auto (each stage's chosen to fit "
                             "--memory-limit): memory is counted with it, and run.py defaults to it (default none)")
    parser.add_argument("--expert-imbalance", type=float, default=1.0, metavar="X",
                        help="with --ep: plan each rank's memory for receiving X times the balanced number of "
                             "routed rows for its experts (the busiest expert over the mean, as run.py's metrics "
                             "report 'experts max/mean'; default 1: balanced)")
    parser.add_argument("--memory-limit", default=None, metavar="SIZE",
                        help="the bytes a rank may hold at its peak (e.g. 80GB, 75GiB): with --activation-"
                             "checkpointing auto each stage's checkpointing is chosen to fit it; otherwise a plan "
                             "over it is refused, naming the ranks and what would fit")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where the job will run, for the memory plan: cuda (NCCL; torch's optimizers take "
                             "their foreach kernels) or cpu (gloo, shared-memory rings); default: cuda if this "
                             "machine has it, else cpu")
    parser.add_argument("--optimizer", default=None, choices=["sgd", "adamw"],
                        help="the optimizer run.py builds when the model file has no optimizer(params): its state "
                             "is counted in each rank's peak, and run.py defaults to it (default: the model file's, "
                             "else sgd)")


def _layout(args):
    """The one value of the parallel layout the split options describe."""
    from tracepp.runtime.mesh import Layout

    return Layout(pp=args.ranks, dp=args.dp, dp_mode=args.dp_mode, dp_shard=args.dp_shard, dp_order=args.dp_order,
                  tp=args.tp, ep=args.ep, sequence_parallel=args.sequence_parallel, cp=args.cp)


def _run_options(args):
    """The one value of the training options that change memory (what run.py defaults to)."""
    from tracepp.runtime.run_options import RunOptions

    import torch

    from tracepp.costs.search import parse_bytes

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    return RunOptions(precision=args.precision, mixed_precision=args.mixed_precision, fp8_recipe=args.fp8_recipe,
                      activation_checkpointing=args.activation_checkpointing,
                      optimizer=args.optimizer, expert_imbalance=args.expert_imbalance, device=device,
                      memory_limit=limit)


def _split_points(text):
    """``--split-points a,b`` -> ["a", "b"]; ``auto`` -> "auto" (cut automatically even where the model file
    lists split points); absent -> None (the model file's, else automatic)."""
    if not text:
        return None
    if text.strip() == "auto":
        return "auto"
    return [point.strip() for point in text.split(",") if point.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracepp", description="Pipeline-parallel training from one traced model.")
    sub = parser.add_subparsers(dest="command", required=True)
    split = sub.add_parser("split", help="trace a model file and write a runnable pipeline folder")
    check = sub.add_parser("check", help="trace, split and plan; print the stage table and warnings; write nothing")
    split.add_argument("-o", "--out", default="out", help="output folder (default: out)")
    split.add_argument("--dry-run", action="store_true", help="do what `tracepp check` does: write nothing")
    split.add_argument("--bundle", action="append", default=None, metavar="PKG",
                       help="copy this local package or module the model file imports into the output folder, "
                            "so it runs where the model's source tree is absent (repeatable)")
    for command in (split, check):
        _add_split_options(command)
    split.set_defaults(run=_split)
    check.set_defaults(run=_check)
    inspect = sub.add_parser("inspect", help="print the stage table and the plan of an output folder")
    inspect.add_argument("out")
    inspect.add_argument("--grid", action="store_true", help="also print every rank's action grid")
    inspect.add_argument("--json", action="store_true",
                         help="print the figures as JSON for scripts instead of tables: per stage its estimate and "
                              "memory figures, per pipeline rank its peak (ranks[i].peak_bytes) and its parts")
    inspect.set_defaults(run=_inspect)
    from tracepp.runtime.replay import UNIT_COSTS

    plan = sub.add_parser("plan", help="show the schedule: action grid, bubble, in-flight, timeline picture")
    plan.add_argument("out")
    plan.add_argument("--svg", default=None, help="timeline picture path (default: OUT/plan.svg)")
    plan.add_argument("--trace", default=None, help="Chrome-trace JSON path (default: OUT/plan_trace.json)")
    plan.add_argument("--costs", default=None, metavar="COSTS.json",
                      help='measured compute times per action kind, e.g. {"F": 1.0, "B": 2.0}, or per stage, '
                           'e.g. {"0F": 1.2, "1B": 2.5} (default: the unit costs '
                           + ", ".join(f"{kind}={cost:g}" for kind, cost in UNIT_COSTS.items()) + ")")
    plan.add_argument("--calibration", default=None, metavar="FILE",
                      help="calibration file for the predicted step time and --tune (default: OUT/calibration.json)")
    plan.add_argument("--tune", action="store_true",
                      help="search schedule, stages per rank, microbatches and split points with the calibrated "
                           "simulator; print the best plans")
    plan.add_argument("--memory-limit", default=None, metavar="SIZE",
                      help="--tune: drop plans whose estimated peak memory on some rank exceeds SIZE (e.g. 20GB)")
    plan.add_argument("--top", type=int, default=5, help="--tune: how many plans to print (default 5)")
    plan.add_argument("--tp-sizes", default=None, metavar="T,T",
                      help="--tune: also price every plan with these tensor-parallel sizes (e.g. 1,2,4; from a tp=1 "
                           "folder); plans are ranked by step time x processes, so tp wins where memory needs it "
                           "or it pays for its processes")
    plan.add_argument("--ep-sizes", default=None, metavar="E,E",
                      help="--tune: also price every plan with these expert-parallel sizes (e.g. 1,2,4; from a folder "
                           "split at --dp N without --ep; each must divide N and every block's expert count): expert "
                           "state 1/ep per rank, the all-to-all per microbatch against FSDP's gathering of the experts")
    plan.add_argument("--cp-sizes", default=None, metavar="C,C",
                      help="--tune: also price every plan with these context-parallel sizes (e.g. 1,2,4; from a folder "
                           "split without --cp; 2C must divide the sequence): compute and sequence-held activations "
                           "1/cp per rank, the key/value all-gathers (and dK/dV reduce-scatters) per microbatch, "
                           "boundaries of 1/cp, cp times the processes")
    plan.add_argument("--measure", type=int, default=0, metavar="K",
                      help="--tune: run the K best predicted plans on this machine (each split into a folder of its "
                           "own, a few steps each) and print what each measured beside its prediction; with --apply "
                           "the fastest measured plan is applied")
    plan.add_argument("--measure-steps", type=int, default=5, metavar="N",
                      help="--measure: measured steps per round, after 2 warm-up steps (default 5)")
    plan.add_argument("--measure-rounds", type=int, default=2, metavar="R",
                      help="--measure: rounds, each running every plan (default 2)")
    plan.add_argument("--measure-method", default="auto", choices=["auto", "rounds"],
                      help="--measure: auto (default): the plans' steps in turn in one job where they fit in memory "
                           "together and are pipeline parallel alone (tells plans a few percent apart on a machine "
                           "whose speed drifts), else rounds; rounds: a fresh run of each plan per round, the "
                           "order flipping every round")
    plan.add_argument("--apply", action="store_true",
                      help="--tune, then split OUT again with the best plan (with --measure: the fastest measured)")
    plan.add_argument("--schedules", default=None, help="--tune: only these schedules (comma-separated)")
    plan.add_argument("--microbatch-counts", default=None, metavar="M,M",
                      help="--tune: only these microbatch counts (default: the batch's divisors up to 128)")
    plan.add_argument("--optimizer-bytes-per-param", type=float, default=None,
                      help="--tune: optimizer state bytes per parameter in the memory estimate (default: what the "
                           "split counted for its optimizer, see inspect; else 8, Adam's two fp32 states)")
    _add_calibrate_options(plan, in_plan=True)
    plan.set_defaults(run=_plan)
    calibrate = sub.add_parser("calibrate", help="measure comms, stage costs and runtime overheads on this "
                                                 "machine; write OUT/calibration.json")
    calibrate.add_argument("out")
    calibrate.add_argument("--costs", dest="costs_files", action="append", default=None, metavar="COSTS.json",
                           help="stage costs (the `tracepp plan --costs` format, optionally with \"microbatch_size\"); "
                                "repeat with files measured at other microbatch sizes")
    _add_calibrate_options(calibrate, in_plan=False)
    calibrate.set_defaults(run=_calibrate)
    return parser


def _add_calibrate_options(parser, in_plan: bool) -> None:
    prefix = "--calibrate: " if in_plan else ""
    if in_plan:
        parser.add_argument("--calibrate", action="store_true",
                            help="first measure and write OUT/calibration.json (as `tracepp calibrate OUT`, with "
                                 "--costs as the stage costs)")
        parser.set_defaults(costs_files=None)
    parser.add_argument("--comm", default=None, metavar="COMM.json",
                        help=prefix + "ping-pong results of `torchrun ... -m tracepp.costs.measure_comm --json` (e.g. across "
                                      "nodes) instead of running it here")
    parser.add_argument("--nproc", type=int, default=None,
                        help=prefix + "processes for the ping-pong and the calibration run (default: the plan's ranks "
                                      "x replicas, all on this machine)")
    parser.add_argument("--no-comm", action="store_true", help=prefix + "skip the ping-pong (comms free)")
    parser.add_argument("--fit-steps", type=int, default=12,
                        help=prefix + "steps of the calibration run that fits the runtime overheads (default 12)")
    parser.add_argument("--no-fit", action="store_true", help=prefix + "no calibration run: overheads 0")
    from tracepp.costs.calibrate import FIT_MODE, FIT_MODES, PAIRED_STEPS, REPEATS

    parser.add_argument("--paired-steps", type=int, default=None,
                        help=prefix + f"steps after those of the calibration run, each fitted with the stage costs "
                                      f"its ranks measure right before and after it (tracepp.costs.measure_in_run; default "
                                      f"{PAIRED_STEPS} on CPU hosts, 0 with CUDA; 0: fit the run's median step to the "
                                      f"costs measured apart)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=prefix + f"plain-autograd stage-cost measurements (default {REPEATS}, around the "
                                      f"calibration run): their median is used, their spread recorded as the "
                                      f"machine's noise")
    parser.add_argument("--no-runtime", action="store_true",
                        help=prefix + "skip timing the stages through tracepp's executor against the stage functions "
                                      "alone (the runtime factors; then 1)")
    parser.add_argument("--overhead", default=None, choices=FIT_MODES,
                        help=prefix + f"what the calibration run fits: a fixed rank time per action (busy), a delay "
                                      f"per message (delay) or a slowdown of every compute action (scale); default "
                                      f"{FIT_MODE}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileExistsError, FileNotFoundError) as error:  # our errors name the fix; no traceback
        print(f"tracepp {args.command}: error: {error}", file=sys.stderr)
        return 2
    finally:
        if getattr(args, "timings", None):
            _report_timings(args.timings)


def _report_timings(path: str) -> None:
    """``--timings``: the driver's steps (``tracepp.phases``) to stderr, and as JSON to ``path`` unless it is -."""
    import json

    from tracepp import phases

    steps = phases.taken()
    print(phases.table(steps), file=sys.stderr)
    if path != "-":
        with open(path, "w") as handle:
            json.dump({"steps": steps, "total_wall_s": round(sum(s["wall_s"] for s in steps if "/" not in s["name"]), 3),
                       "peak_rss_bytes": max((s["peak_rss_bytes"] for s in steps), default=0)}, handle, indent=1)


if __name__ == "__main__":
    sys.exit(main())
