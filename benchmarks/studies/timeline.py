"""Where a measured step's time goes, action by action, next to the calibrated simulator's timeline.

    torchrun --nproc-per-node R -m benchmarks.studies.timeline OUT_DIR --json timeline.json -- --steps 12 --quiet
    python -m benchmarks.studies.timeline --summary timeline.json [--calibration OUT_DIR/calibration.json]

The first form runs the folder's ``run.py`` with an action hook (the runtime's public
``Pipeline.set_action_hook``, installed through ``register_step_hook``): every action's start and end on every
rank (``time.perf_counter``: one clock for all processes of a machine) for every step; each rank writes
``timeline.json.rank<R>``. The hook costs one Python call per action. A compute action's time includes its
wait for the data it receives (the runtime waits right before the compute); a comm batch's is the time to post it.

``--summary`` prints, per rank, the medians over the steps after the warm-up of the step, its compute actions
(their wall time, of it the thread's CPU time, and the rest: waiting for received data), its comm posting
and the time between actions (the runtime's own Python, the optimizer step), then each kind's median action
time, and with ``--calibration`` the simulator's cost of the same actions: where a
prediction's error comes from (compute slower in the run than alone, comm posting, waits).
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

WARMUP = 3


def _record(out_dir: str, path: str, rest: list) -> None:
    sys.path.insert(0, os.path.abspath(out_dir))
    import tracepp_runtime

    records = []
    state = {"step": -1}

    def at_step(pipeline, step: int) -> None:
        state["step"] = step
        if pipeline.executor.action_hook is None:
            def hook(label, run):
                start, cpu = time.perf_counter(), time.thread_time()
                run()
                records.append((state["step"], label, start, time.perf_counter(), time.thread_time() - cpu))
            pipeline.set_action_hook(hook)
        records.append((step, "STEP", time.perf_counter(), None, None))

    tracepp_runtime.register_step_hook(at_step)
    sys.argv = [os.path.join(out_dir, "run.py")] + rest
    runpy.run_path(os.path.join(out_dir, "run.py"), run_name="__main__")
    with open(f"{path}.rank{os.environ.get('RANK', '0')}", "w") as handle:
        json.dump(records, handle)


def _kind(label: str) -> str:
    if "SEND" in label or "RECV" in label:
        return "comm"
    return label.lstrip("0123456789")[:1]  # "0F3" -> "F", "1W0" -> "W"


def summarize(path: str, calibration_path=None) -> str:
    from tabulate import tabulate

    rows = []
    for rank_file in sorted(glob.glob(path + ".rank*")):
        rank = int(rank_file.rsplit("rank", 1)[1])
        with open(rank_file) as handle:
            records = json.load(handle)
        steps: dict = {}
        for step, label, start, end, *cpu in records:  # cpu: the action's thread CPU time (older files: none)
            steps.setdefault(step, []).append((label, start, end, cpu[0] if cpu else None))
        per_kind: dict = {}
        parts: dict = {}
        for step in sorted(steps)[WARMUP:-1]:
            items = steps[step][1:]
            begin, finish = steps[step][0][1], steps[step + 1][0][1]
            compute = [(e - s, c) for label, s, e, c in items if _kind(label) != "comm"]
            comm = [e - s for label, s, e, c in items if _kind(label) == "comm"]
            cpu = [c for _, c in compute if c is not None]
            compute_s, comm_s = sum(w for w, _ in compute), sum(comm)
            values = {"step": finish - begin, "compute": compute_s, "comm": comm_s,
                      "between": finish - begin - compute_s - comm_s}
            if len(cpu) == len(compute):  # a compute action's wall time minus its CPU time: waiting on its input
                values["compute_cpu"], values["wait"] = sum(cpu), compute_s - sum(cpu)
            for key, value in values.items():
                parts.setdefault(key, []).append(value)
            for label, s, e, c in items:
                per_kind.setdefault(_kind(label), []).append(e - s)
        if not parts:
            continue
        count = len(parts["step"])
        ms = lambda key: f"{statistics.median(parts[key]) * 1000:.1f}" if key in parts else "-"
        row = [rank] + [ms(key) for key in ("step", "compute", "compute_cpu", "wait", "comm", "between")]
        for kind in ("F", "B", "I", "W", "comm"):
            values = per_kind.get(kind)
            row.append(f"{statistics.median(values) * 1000:.2f} x{len(values) // count}" if values else "-")
        rows.append(row)
    text = tabulate(rows, headers=["rank", "step ms", "compute ms", "of it CPU", "of it waiting", "comm post ms",
                                   "between actions ms", "F ms", "B ms", "I ms", "W ms", "one comm post ms"],
                    tablefmt="simple", disable_numparse=True)
    if calibration_path:
        from tracepp.costs.model import load_calibration

        calibration = load_calibration(calibration_path)
        size = calibration.folder.get("microbatch_size")
        costs = calibration.runtime_costs(calibration.stage_costs(size)) if size else {}  # as the simulator prices
        compute_s, op_s, _ = calibration.overheads()
        text += ("\ncalibrated: " + ", ".join(f"{s}{k} {v * 1000:.2f}" for (s, k), v in sorted(costs.items()))
                 + f" ms; overhead {compute_s * 1e6:.0f} us per action, {op_s * 1e6:.0f} us per comm op, "
                   f"{calibration.message_delay() * 1e6:.0f} us delay per message")
    return text


def main(argv=None) -> int:
    from tracepp.costs.measure_in_run import split_run_args

    argv, rest = split_run_args(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--json", default=None)
    parser.add_argument("--summary", default=None)
    parser.add_argument("--calibration", default=None)
    args = parser.parse_args(argv)
    if args.summary:
        print(summarize(args.summary, args.calibration))
        return 0
    _record(args.out_dir, args.json, rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
