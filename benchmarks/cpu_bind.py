"""What binding each CPU rank to its own cores (``run.py --cpu-bind auto``, the default) does to tracepp's step
time, against ``--cpu-bind none``, on the quick suite's cases (d128 GPT, 2 ranks).

    python -m benchmarks.cpu_bind [--rounds 4] [--steps 10] [--out benchmarks/results]

The same output folder of each case runs under torchrun with one flag and then the other, alternating which
goes first from round to round; each run drops its warm-up steps, and a mode's step time is the median of all
its measured steps (``--metrics`` of the last stage's rank, as in ``benchmarks/run.py``). Prints a table and
writes ``OUT/<date>_cpu_bind.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile

from benchmarks.gpt_model import write_model_file
from benchmarks.predict import loadavg
from benchmarks.run import Settings, cpu_cases, run_system

MODES = ("auto", "none")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    from tracepp.driver import split_model

    settings = Settings(rounds=args.rounds, warmup=args.warmup, measured=args.steps, timeout=300.0)
    started = datetime.datetime.now()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tracepp_cpu_bind_") as work:
        for case in cpu_cases(quick=True):
            case_dir = os.path.join(work, case.key)
            model_path = write_model_file(os.path.join(case_dir, "model.py"), case.config, case.stages)
            out_dir = os.path.join(case_dir, "tracepp_out")
            split_model(model_path, out_dir, num_ranks=case.run_ranks, num_stages=case.stages,
                        schedule=case.schedule, num_microbatches=case.microbatches,
                        split_points=case.config.split_points(case.stages))
            times = {mode: [] for mode in MODES}
            for round_index in range(args.rounds):
                for mode in MODES[::-1] if round_index % 2 else MODES:
                    result = run_system("tracepp", case, model_path, out_dir, case_dir, round_index, settings, "cpu",
                                        1, run_args=("--cpu-bind", mode), tag=f"-{mode}")
                    if not result["ok"]:
                        raise SystemExit(f"{case.key} --cpu-bind {mode}: {result['error']} (log {result['log']})")
                    times[mode] += result["step_times"]
            row = {"case": case.key, "schedule": case.schedule, "microbatches": case.microbatches,
                   "stages": case.stages, "loadavg_after": loadavg(),
                   **{f"{mode}_step_s": statistics.median(times[mode]) for mode in MODES},
                   **{f"{mode}_step_times_s": times[mode] for mode in MODES}}
            row["auto_over_none"] = row["auto_step_s"] / row["none_step_s"]
            rows.append(row)
            print(f"{case.key:40s} auto {row['auto_step_s'] * 1e3:7.1f} ms  none {row['none_step_s'] * 1e3:7.1f} ms  "
                  f"auto/none {row['auto_over_none']:.2f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{started.strftime('%Y%m%d-%H%M%S')}_cpu_bind.json")
    with open(path, "w") as handle:
        json.dump({"started": started.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds, "warmup": args.warmup,
                   "steps": args.steps, "cpus": os.cpu_count(), "results": rows}, handle, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
