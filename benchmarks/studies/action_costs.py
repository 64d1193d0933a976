"""Each compute action's time in a run against its stage's plain-autograd cost, both measured by the same rank in the
same run: which kind of action the runtime makes slower than the stage function alone, and by how much.

    torchrun --nproc-per-node R -m benchmarks.studies.action_costs OUT_DIR --json costs.json [--first 5 --count 14] \\
        -- --steps 22 --quiet
    python -m benchmarks.studies.action_costs --summary costs.json

The first form runs the folder's ``run.py`` with

* an action hook (the runtime's ``Pipeline.set_action_hook``) timing every compute action of every step, and the
  time it spends waiting for data it receives (the executor's ``_wait``) counted apart: a wait is the schedule's
  or the peer's, not the action's cost;
* :class:`tracepp.costs.measure_in_run.PairedCosts` between steps ``first - 1`` ... ``first + count - 1``: every rank times
  its own stages with plain autograd (F, B, I, W = B - I; ``tracepp.costs.measure_stages``), all ranks at once between two
  barriers, outside the steps' timing.

Each rank writes ``costs.json.rank<R>``. ``--summary`` prints, per rank and (stage, kind), the median time of the
actions of the ``count`` steps without their waits, the median plain cost of the rounds around them, their ratio
and the actions per step, then per rank the sums over a step: the rank's compute in the run against the same
actions priced alone. That ratio is the compute's share of a measured step's distance from its ideal (which prices
the plan with the plain costs); the rest is comm posting, waits and the step's end (``benchmarks.studies.timeline``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import runpy
import statistics
import sys
import time

from tracepp.runtime.actions import Action


def _record(out_dir: str, path: str, first: int, count: int, rest: list) -> None:
    out_dir = os.path.abspath(out_dir)
    sys.path.insert(0, out_dir)
    import tracepp_runtime
    from tracepp_runtime import executor

    from tracepp.costs.measure_in_run import PairedCosts

    rank = int(os.environ.get("RANK", "0"))
    paired_prefix = f"{path}.paired"
    records, steps, state = [], {}, {"step": -1, "wait": 0.0}

    def at_step_end(pipeline, step: int) -> None:  # registered first: runs before the plain meter's round
        steps[step] = (steps[step][0], time.perf_counter())

    tracepp_runtime.register_step_end_hook(at_step_end)
    PairedCosts(out_dir, first, count, paired_prefix, rank).register(tracepp_runtime)
    plain_wait = executor.RankExecutor._wait

    def timed_wait(self, works):
        start = time.perf_counter()
        try:
            return plain_wait(self, works)
        finally:
            state["wait"] += time.perf_counter() - start

    executor.RankExecutor._wait = timed_wait

    def at_step(pipeline, step: int) -> None:
        state["step"] = step
        steps[step] = (time.perf_counter(), None)
        if pipeline.executor.action_hook is None:
            def hook(label, run):
                state["wait"] = 0.0
                start = time.perf_counter()
                run()
                records.append((state["step"], label, time.perf_counter() - start, state["wait"], start))
            pipeline.set_action_hook(hook)

    tracepp_runtime.register_step_hook(at_step)
    sys.argv = [os.path.join(out_dir, "run.py")] + rest
    runpy.run_path(os.path.join(out_dir, "run.py"), run_name="__main__")
    if not os.path.exists(f"{paired_prefix}.rank{rank}.json"):
        raise SystemExit(f"rank {rank}: the run ended before step {first + count - 1}, the last one compared: pass "
                         f"--steps {first + count + 2} or more to run.py (after --), or a smaller --first/--count")
    with open(f"{paired_prefix}.rank{rank}.json") as handle:
        paired = json.load(handle)
    with open(f"{path}.rank{rank}", "w") as handle:
        json.dump({"rank": rank, "first": first, "count": count, "actions": records, "rounds": paired["rounds"],
                   "steps": {step: [start, end] for step, (start, end) in steps.items() if end is not None},
                   "error": paired.get("error")}, handle)
    os.remove(f"{paired_prefix}.rank{rank}.json")


def summarize(actions: list, rounds: list, first: int, count: int, steps: dict = None) -> dict:
    """``actions``: ``[(step, label, seconds, seconds waiting[, start])]``; ``rounds``: the paired rounds (``[{"costs": {"0F":
    s, ...} or None}]``, the first dropped as in ``tracepp.costs.measure_in_run.read_paired``). Returns ``{"kinds": {"1I":
    {"run_s", "plain_s", "ratio", "wait_s", "per_step"}}, "run_s", "plain_s", "ratio", "wait_s", "step_s"}``:
    medians over the compute actions of steps ``first`` ... ``first + count - 1`` (comm actions left out), the sums
    per step over the kinds that have a plain cost (``wait_s`` over every kind), and with ``steps`` (``{"step":
    [start, end]}``, the step's start and end hooks' clocks) the median step and, from the actions' starts, the
    medians of the time before the first action, posting comms, between actions and after the last one."""
    plain: dict = {}
    for found in rounds[1:]:
        for key, value in (found.get("costs") or {}).items():
            plain.setdefault(key, []).append(value)
    run: dict = {}
    comm, head, tail, gaps, last_end = {}, {}, {}, {}, {}
    for step, label, seconds, waited, *start in actions:
        if not first <= step < first + count:
            continue
        if start and steps and str(step) in steps:
            begin, end = steps[str(step)]
            if step not in head:
                head[step] = start[0] - begin
            else:
                gaps[step] = gaps.get(step, 0.0) + start[0] - last_end[step]
            last_end[step] = start[0] + seconds
            tail[step] = end - last_end[step]
        action = Action.parse(label.split()[0])  # a comm batch's label lists its actions
        if action.is_comm:
            comm[step] = comm.get(step, 0.0) + seconds
            continue
        run.setdefault(f"{action.stage}{action.kind}", []).append((seconds - waited, waited))
    kinds, run_total, plain_total, wait_total = {}, 0.0, 0.0, 0.0
    for key in sorted(run, key=lambda k: (int(k[:-1]), k[-1])):
        own = statistics.median(t for t, _w in run[key])
        row = {"run_s": own, "wait_s": statistics.median(w for _t, w in run[key]), "per_step": len(run[key]) / count}
        if plain.get(key):
            row["plain_s"] = statistics.median(plain[key])
            row["ratio"] = own / row["plain_s"] if row["plain_s"] > 1e-6 else None
            run_total += own * row["per_step"]
            plain_total += row["plain_s"] * row["per_step"]
        wait_total += row["wait_s"] * row["per_step"]
        kinds[key] = row
    compared = [end - begin for step, (begin, end) in (steps or {}).items() if first <= int(step) < first + count]

    def median_of(found: dict):
        return statistics.median(found.values()) if found else None

    return {"kinds": kinds, "run_s": run_total, "plain_s": plain_total, "wait_s": wait_total,
            "ratio": run_total / plain_total if plain_total else None,
            "step_s": statistics.median(compared) if compared else None,
            "comm_s": median_of(comm), "head_s": median_of(head), "gaps_s": median_of(gaps),
            "tail_s": median_of(tail)}


def _summary(path: str) -> None:
    for file in sorted(glob.glob(f"{path}.rank*")):
        with open(file) as handle:
            found = json.load(handle)
        if found.get("error"):
            print(f"rank {found['rank']}: the plain meter failed: {found['error']}")
            continue
        result = summarize(found["actions"], found["rounds"], found["first"], found["count"], found.get("steps"))
        print(f"rank {found['rank']} ({found['count']} steps):")
        for key, row in result["kinds"].items():
            plain = f"plain {row['plain_s'] * 1e3:.3f} ms  run/plain {row['ratio']:.3f}" if row.get("ratio") else \
                "plain -"
            print(f"  {key:>4}: run {row['run_s'] * 1e3:.3f} ms (+ waiting {row['wait_s'] * 1e3:.3f})  {plain}  "
                  f"x{row['per_step']:.0f} per step")
        if result["ratio"]:
            print(f"  per step: compute {result['run_s'] * 1e3:.1f} ms in the run, {result['plain_s'] * 1e3:.1f} ms "
                  f"alone, run/plain {result['ratio']:.3f}; waiting inside actions {result['wait_s'] * 1e3:.1f} ms")
        if result["step_s"]:
            rest = result["step_s"] - result["run_s"] - result["wait_s"]
            print(f"  step {result['step_s'] * 1e3:.1f} ms (median): compute {result['run_s'] * 1e3:.1f} + waiting "
                  f"{result['wait_s'] * 1e3:.1f} + the rest {rest * 1e3:.1f}")
            parts = [(name, result[key]) for name, key in (("before the first action", "head_s"),
                                                           ("comm posting", "comm_s"), ("between actions", "gaps_s"),
                                                           ("after the last action", "tail_s"))
                     if result.get(key) is not None]
            if parts:
                print("    the rest: " + ", ".join(f"{name} {value * 1e3:.1f}" for name, value in parts) + " ms")


def main(argv=None) -> None:
    from tracepp.costs.measure_in_run import split_run_args

    argv, rest = split_run_args(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.action_costs", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--json", help="record: PATH prefix of the per-rank files")
    parser.add_argument("--summary", help="summarize the files of PATH")
    parser.add_argument("--first", type=int, default=5, help="the first step compared (after warm-up)")
    parser.add_argument("--count", type=int, default=14, help="how many steps are compared")
    args = parser.parse_args(argv)
    if args.summary:
        _summary(args.summary)
        return
    if not args.out_dir or not args.json:
        parser.error("record with OUT_DIR --json PATH -- RUN_ARGS (under torchrun), or print with --summary PATH")
    _record(args.out_dir, os.path.abspath(args.json), args.first, args.count, rest)


if __name__ == "__main__":
    main()
