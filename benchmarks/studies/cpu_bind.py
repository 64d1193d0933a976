"""What binding each CPU rank to its own cores (``run.py --cpu-bind auto``, the default) does to tracepp's step
time, against ``--cpu-bind none``, on the quick suite's cases (d128 GPT, 2 ranks); and the same binding given to
torch's pipelining (``benchmarks/torch_worker.py --cpu-bind auto``), so tracepp/torch can be read with both
bound as well as with each as it runs by default.

    python -m benchmarks.studies.cpu_bind [--rounds 4] [--steps 10] [--systems tracepp,torch] [--out benchmarks/results]

For each case the four runs (tracepp and torch, bound and unbound) alternate, their order reversed from round
to round; each run drops its warm-up steps, and a run kind's step time is the median of all its measured steps
(the last stage's rank, as in ``benchmarks/run.py``). Prints a table and writes ``OUT/<date>_cpu_bind.json``.
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
    parser.add_argument("--systems", default="tracepp,torch", help="tracepp, torch or both (comma-separated)")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    systems = [name for name in args.systems.split(",") if name]
    if not systems or any(name not in ("tracepp", "torch") for name in systems):
        parser.error(f"--systems {args.systems}: expected tracepp, torch or tracepp,torch")
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    settings = Settings(rounds=args.rounds, warmup=args.warmup, measured=args.steps, timeout=300.0)
    started = datetime.datetime.now()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tracepp_cpu_bind_") as work:
        for case in cpu_cases(quick=True):
            case_dir = os.path.join(work, case.key)
            model_path = write_model_file(os.path.join(case_dir, "model.py"), case.config, case.stages)
            out_dir = os.path.join(case_dir, "tracepp_out")
            split_model(model_path, out_dir, num_stages=case.stages,
                        schedule=case.schedule, num_microbatches=case.microbatches,
                        split_points=case.config.split_points(case.stages), layout=Layout(pp=case.run_ranks))
            kinds = [(system, mode) for system in systems for mode in MODES]
            times = {kind: [] for kind in kinds}
            for round_index in range(args.rounds):
                for system, mode in kinds[::-1] if round_index % 2 else kinds:
                    result = run_system(system, case, model_path, out_dir, case_dir, round_index, settings, "cpu",
                                        1, run_args=("--cpu-bind", mode), tag=f"-{mode}")
                    if not result["ok"]:
                        raise SystemExit(f"{case.key} {system} --cpu-bind {mode}: {result['error']} "
                                         f"(log {result['log']})")
                    times[(system, mode)] += result["step_times"]
            row = {"case": case.key, "schedule": case.schedule, "microbatches": case.microbatches,
                   "stages": case.stages, "loadavg_after": loadavg()}
            for system, mode in kinds:
                row[f"{system}_{mode}_step_s"] = statistics.median(times[(system, mode)])
                row[f"{system}_{mode}_step_times_s"] = times[(system, mode)]
            text = f"{case.key:40s}"
            for system in systems:
                row[f"{system}_auto_over_none"] = row[f"{system}_auto_step_s"] / row[f"{system}_none_step_s"]
                text += (f"  {system} bound {row[f'{system}_auto_step_s'] * 1e3:6.1f} ms, unbound "
                         f"{row[f'{system}_none_step_s'] * 1e3:6.1f} ms ({row[f'{system}_auto_over_none']:.2f})")
            if len(systems) == 2:
                for mode in MODES:
                    row[f"tracepp_over_torch_{mode}"] = row[f"tracepp_{mode}_step_s"] / row[f"torch_{mode}_step_s"]
                row["tracepp_bound_over_torch_unbound"] = row["tracepp_auto_step_s"] / row["torch_none_step_s"]
                text += (f"  tracepp/torch: both bound {row['tracepp_over_torch_auto']:.2f}, both unbound "
                         f"{row['tracepp_over_torch_none']:.2f}, as shipped {row['tracepp_bound_over_torch_unbound']:.2f}")
            rows.append(row)
            print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{started.strftime('%Y%m%d-%H%M%S')}_cpu_bind.json")
    with open(path, "w") as handle:
        json.dump({"started": started.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds, "warmup": args.warmup,
                   "steps": args.steps, "systems": systems, "cpus": os.cpu_count(), "results": rows}, handle,
                  indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
