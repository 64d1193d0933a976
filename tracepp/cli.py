"""The ``tracepp`` command line: ``split`` a model file into a runnable pipeline, ``inspect`` or ``plan`` it.

    tracepp split model.py -o out/ [--ranks R] [--stages N] [--schedule NAME|file.csv] [--microbatches M]
                                   [--split-points a,b] [--dynamic NAME:DIM=SYMBOL ...]
    tracepp inspect out/
    tracepp plan out/ [--svg plan.svg] [--trace plan.json]
"""
from __future__ import annotations

import argparse
import sys


def _split(args) -> int:
    from tracepp.driver import split_model

    points = [p.strip() for p in args.split_points.split(",") if p.strip()] if args.split_points else None
    manifest = split_model(args.model, args.out, num_ranks=args.ranks, num_stages=args.stages,
                           schedule=args.schedule, num_microbatches=args.microbatches, split_points=points,
                           dynamic_shapes=_dynamic(args.dynamic, args.model) if args.dynamic else None)
    from tracepp.inspect import stage_table

    print(stage_table(manifest))
    print(f"\nwrote {args.out}: manifest.json, run.py, "
          f"{', '.join(f'rank{r}.py' for r in range(manifest['plan']['num_ranks']))}, weights/, tracepp_runtime/")
    print(f"run it: {manifest['launch_command']} --steps 3")
    return 0


def _dynamic(specs: list, model_path: str):
    from tracepp.dynamic import dynamic_shapes_from_flags

    return dynamic_shapes_from_flags(specs, model_path)


def _inspect(args) -> int:
    from tracepp.inspect import load_manifest, plan_report, stage_table

    manifest = load_manifest(args.out)
    print(stage_table(manifest))
    print()
    print(plan_report(manifest, grid=args.grid))
    return 0


def _plan(args) -> int:
    from tracepp.inspect import load_manifest, plan_report, write_plan_pictures

    manifest = load_manifest(args.out)
    print(plan_report(manifest, grid=True))
    for path in write_plan_pictures(manifest, args.svg, args.trace):
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracepp", description="Pipeline-parallel training from one traced model.")
    sub = parser.add_subparsers(dest="command", required=True)
    split = sub.add_parser("split", help="trace a model file and write a runnable pipeline folder")
    split.add_argument("model", help="model file defining model() and example_inputs() (see README)")
    split.add_argument("-o", "--out", default="out", help="output folder (default: out)")
    split.add_argument("--ranks", type=int, default=2, help="pipeline ranks, i.e. torchrun processes (default 2)")
    split.add_argument("--stages", type=int, default=None,
                       help="number of stages (default: from split points, else ranks x stages per rank)")
    split.add_argument("--schedule", default="1f1b",
                       help="gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zb, zbv, dualpipev, or a .csv")
    split.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (default 4)")
    split.add_argument("--split-points", default=None,
                       help="comma-separated module FQNs where a new stage begins (overrides the model file's)")
    split.add_argument("--dynamic", action="append", default=None, metavar="INPUT:DIM=SYMBOL",
                       help="mark a dim of a named input dynamic, e.g. idx:1=seq (repeatable)")
    split.set_defaults(run=_split)
    inspect = sub.add_parser("inspect", help="print the stage table and the plan of an output folder")
    inspect.add_argument("out")
    inspect.add_argument("--grid", action="store_true", help="also print every rank's action grid")
    inspect.set_defaults(run=_inspect)
    plan = sub.add_parser("plan", help="show the schedule: action grid, bubble, in-flight, timeline picture")
    plan.add_argument("out")
    plan.add_argument("--svg", default=None, help="timeline picture path (default: OUT/plan.svg)")
    plan.add_argument("--trace", default=None, help="Chrome-trace JSON path (default: OUT/plan_trace.json)")
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
