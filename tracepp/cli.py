"""The ``tracepp`` command line: ``split`` a model file into a runnable pipeline, ``inspect`` or ``plan`` it.

    tracepp split model.py -o out/ [--ranks R] [--stages N] [--schedule NAME|file.csv] [--microbatches M]
                                   [--split-points a,b] [--dynamic NAME:DIM=SYMBOL ...] [--bundle PKG ...]
                                   [--dp N] [--dp-mode fsdp|ddp|hsdp] [--dp-shard K] [--dp-order pp-inner|dp-inner]
    tracepp check model.py [split options]      # trace, split, plan; print the stage table and warnings
    tracepp inspect out/
    tracepp plan out/ [--svg plan.svg] [--trace plan.json] [--costs measured.json]
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
    manifest = split_model(args.model, args.out, num_ranks=args.ranks, num_stages=args.stages,
                           schedule=args.schedule, num_microbatches=args.microbatches, split_points=points,
                           dynamic_shapes=parse_flags(args.dynamic) if args.dynamic else None,
                           dp=args.dp, dp_mode=args.dp_mode, dp_shard=args.dp_shard, dp_order=args.dp_order)
    from tracepp.modelfile import bundle_packages
    from tracepp.runtime.mesh import describe
    from tracepp.stage_report import stage_table

    bundled = bundle_packages(args.out, args.bundle, manifest["import_paths"]) if args.bundle else []
    for note in manifest.get("notes", []):
        print(f"note: {note}")
    print(stage_table(manifest))
    for line in describe(manifest["plan"]):
        print(line)
    print(f"\nwrote {args.out}: manifest.json, run.py, "
          f"{', '.join(f'rank{r}.py' for r in range(manifest['plan']['num_ranks']))}, tracepp_runtime/"
          + "".join(f", {os.path.basename(path)}" for path in bundled)
          + " (no weights: each rank loads its own with --load CKPT or builds them from model())")
    world = manifest["plan"]["num_ranks"] * (manifest["plan"].get("mesh") or {}).get("dp", 1)
    print(f"run it: {launch_command(world, args.out)} --steps 3")
    return 0


def _check(args) -> int:
    """Trace, split and plan; print the stage table and the warnings; write nothing."""
    from tracepp.check import stage_warnings
    from tracepp.driver import check_model
    from tracepp.dynamic import parse_flags
    from tracepp.stage_report import stage_table

    _check_layout(args)
    points = _split_points(args.split_points)
    manifest = check_model(args.model, num_ranks=args.ranks, num_stages=args.stages, schedule=args.schedule,
                           num_microbatches=args.microbatches, split_points=points,
                           dynamic_shapes=parse_flags(args.dynamic) if args.dynamic else None)
    for note in manifest.get("notes", []):
        print(f"note: {note}")
    print(stage_table(manifest))
    warnings = stage_warnings(manifest)
    print()
    for warning in warnings:
        print(f"warning: {warning}")
    print(f"{len(warnings)} warning(s); nothing written. `tracepp split` with the same options writes the folder.")
    return 0


def _check_layout(args) -> None:
    """Reject impossible rank/stage/schedule combinations before tracing (which takes a while)."""
    if args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks}: need at least 1 rank")
    if args.microbatches < 1:
        raise ValueError(f"--microbatches {args.microbatches}: need at least 1 microbatch")
    from tracepp.codegen.schedules import (SCHEDULES, check_full_backward, check_stages_divide, is_csv,
                                           placement)

    if getattr(args, "dp", 1) > 1 and args.schedule in SCHEDULES:
        check_full_backward(args.schedule, args.dp_mode)
    if args.stages is None:
        return
    if args.stages < 1:
        raise ValueError(f"--stages {args.stages}: need at least 1 stage")
    if is_csv(args.schedule):
        check_stages_divide(args.stages, args.ranks)
    elif args.schedule in SCHEDULES:  # an unknown name is reported by the planner with the list of valid ones
        placement(args.schedule, args.ranks, args.stages)


def _inspect(args) -> int:
    from tracepp.manifest_file import load_manifest
    from tracepp.plan_report import plan_report
    from tracepp.runtime.mesh import describe
    from tracepp.stage_report import boundary_table, estimate_table, stage_table

    manifest = load_manifest(args.out)
    print(stage_table(manifest))
    for section in (estimate_table(manifest), boundary_table(manifest)):
        if section:
            print()
            print(section)
    print()
    print(plan_report(manifest, grid=args.grid))
    for line in describe(manifest["plan"]):  # data parallel: which global ranks replicate which pipeline rank
        print(line)
    return 0


def _plan(args) -> int:
    from tracepp.costs_file import load_costs
    from tracepp.manifest_file import load_manifest
    from tracepp.plan_report import plan_report, write_plan_pictures

    manifest = load_manifest(args.out)
    costs = load_costs(args.costs, len(manifest["stages"])) if args.costs else None
    print(plan_report(manifest, grid=True, costs=costs))
    for path in write_plan_pictures(manifest, args.svg, args.trace, costs=costs):
        print(f"wrote {path}")
    return 0


def _add_split_options(parser) -> None:
    parser.add_argument("model", help="model file defining model() and example_inputs() (see README)")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks, i.e. torchrun processes (default 2)")
    parser.add_argument("--stages", type=int, default=None,
                        help="number of stages (default: from split points, else ranks x stages per rank)")
    from tracepp.codegen.schedules import SCHEDULES

    parser.add_argument("--schedule", default="1f1b", help=f"{', '.join(SCHEDULES)}, or a .csv")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (default 4)")
    parser.add_argument("--split-points", default=None,
                        help="comma-separated module FQNs where a new stage begins (overrides the model file's); "
                             "'auto' cuts between repeated blocks by the cost model even if the file lists points")
    parser.add_argument("--dynamic", action="append", default=None, metavar="INPUT:DIM=SYMBOL",
                        help="mark a dim of a named input dynamic, e.g. idx:1=seq (repeatable)")


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
    split.add_argument("--dp", type=int, default=1,
                       help="data-parallel replicas of the pipeline: the job runs ranks x dp processes (default 1)")
    split.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "ddp", "hsdp"],
                       help="fully_shard each stage over dp (default), replicate it (DDP), or HSDP with --dp-shard")
    split.add_argument("--dp-shard", type=int, default=None, metavar="K",
                       help="hsdp: shard over K ranks, replicate over dp / K")
    split.add_argument("--dp-order", default="pp-inner", choices=["pp-inner", "dp-inner"],
                       help="pp-inner (default): consecutive global ranks form one pipeline; dp-inner: "
                            "consecutive ranks are replicas of one pipeline rank")
    split.set_defaults(run=_split)
    check.set_defaults(run=_check)
    inspect = sub.add_parser("inspect", help="print the stage table and the plan of an output folder")
    inspect.add_argument("out")
    inspect.add_argument("--grid", action="store_true", help="also print every rank's action grid")
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
    plan.set_defaults(run=_plan)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileExistsError, FileNotFoundError) as error:  # our errors name the fix; no traceback
        print(f"tracepp {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
