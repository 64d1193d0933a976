"""Does the tuner's pick hold up when every plan it could have picked is measured? (``plan --tune`` against the
whole of its search space, on the quick suite's model.)

    python -m benchmarks.tune_sweep [--rounds 2] [--warmup 2] [--steps 4] [--out benchmarks/results]

The quick suite's GPT (``benchmarks/gpt_model.py``: d128, 8 blocks, vocabulary 256, a batch of 32 x 32 tokens) is
split for 2 ranks (1F1B, 8 microbatches, cut at ``blocks.4``) and calibrated as a user would (``tracepp calibrate``:
the ping-pong, stage costs, a calibration run). The tuner (``tracepp.costs.search.tune``, SGD: no optimizer state)
then prices its whole search space on those 2 ranks: every schedule, stages per rank, microbatch count (the
batch's divisors) and split it generates. Every plan it priced is split and run here, all in paired rounds
(``tracepp.costs.measure_plans``, what ``plan --tune --measure K`` runs for its K best: each round runs every plan
once, the order flipped every round, the warm-up steps dropped, a plan's figure the median of its measured steps).

Reported: every plan's predicted and measured step; where the tuner's unmeasured pick (its #1) ranks among the
measured plans and its measured step over the best measured one (the goal: within 3%); what ``--measure K`` would
have applied for K = 1, 3, 5, 10 (the fastest measured of the K best predicted) over the best; and Spearman's rank
correlation between the predicted and the measured order. ``--limit N`` measures only the N best predicted plans.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import write_result
from benchmarks.gpt_model import GPTConfig, write_model_file


def _spearman(a: list, b: list):
    """Spearman's rank correlation of two equally long lists of values (no ties expected; ties ranked in order)."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0] * len(values)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    if len(a) < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def sweep(work: str, rounds: int, warmup: int, steps: int, limit, log=print) -> dict:
    from tracepp.codegen.manifest import load_manifest
    from tracepp.costs.measure_plans import fastest, measure, summarize
    from tracepp.costs.model import load_calibration
    from tracepp.costs.search import tune
    from tracepp.driver import split_model
    from tracepp.resplit import apply_tuned
    from tracepp.runtime.mesh import Layout, mesh_layout, world_size

    config = GPTConfig(d_model=128, n_layer=8, batch=32, seq=32)
    model = write_model_file(os.path.join(work, "model.py"), config, 2)
    out = os.path.join(work, "out")
    split_model(model, out, num_stages=2, schedule="1f1b", num_microbatches=8, split_points=config.split_points(2),
                layout=Layout(pp=2))
    started = time.perf_counter()
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    calibration_log = subprocess.run([sys.executable, "-m", "tracepp", "calibrate", out], capture_output=True,
                                     text=True, env=environment, timeout=3600)
    if calibration_log.returncode != 0:
        raise RuntimeError(f"tracepp calibrate failed:\n{calibration_log.stdout[-3000:]}\n{calibration_log.stderr[-3000:]}")
    calibrate_s = time.perf_counter() - started
    log(f"calibrated in {calibrate_s:.0f} s")
    manifest = load_manifest(out)
    calibration = load_calibration(out)
    kept, dropped, failed = tune(manifest, calibration, optimizer_bytes_per_param=0)
    log(f"the tuner priced {len(kept)} plans ({len(failed)} refused by the planner); its pick: {kept[0].schedule}, "
        f"{kept[0].num_stages} stages, M={kept[0].num_microbatches}, split {','.join(kept[0].split_points)}, "
        f"predicted {kept[0].step_s * 1000:.1f} ms")
    candidates = kept[:limit] if limit else kept

    def prepare(candidate, folder):
        return world_size(mesh_layout(apply_tuned(manifest, folder, candidate)["plan"]))

    started = time.perf_counter()
    # rounds of separate runs: the whole search space (70 - 90 plans) would not share processes
    plans = measure(candidates, prepare, os.path.join(work, "plans"), rounds=rounds, warmup=warmup, steps=steps,
                    log=log, interleave=False)
    measure_s = time.perf_counter() - started
    rows = summarize(plans)
    ok = [row for row in rows if row["measured_s"] is not None]
    best = min(row["measured_s"] for row in ok)
    pick = rows[0]
    measure_k = {}
    for k in (1, 3, 5, 10):
        chosen = fastest(plans[:k])
        if chosen is not None and k <= len(plans):
            measure_k[str(k)] = {"predicted_rank": chosen.predicted_rank, "measured_s": chosen.measured_s,
                                 "over_best_measured": chosen.measured_s / best}
    return {"model": config.to_json(), "ranks": 2, "calibration_s": calibrate_s, "measure_s": measure_s,
            "calibration_noise": calibration.noise_fraction(), "rounds": rounds, "warmup_steps": warmup,
            "measured_steps": steps, "searched": len(kept) + len(dropped) + len(failed), "priced": len(kept),
            "measured": len(ok), "failed": [row for row in rows if row["measured_s"] is None],
            "pick": {"plan": pick["plan"], "predicted_s": pick["predicted_s"], "measured_s": pick["measured_s"],
                     "measured_rank": pick["measured_rank"], "over_best_measured": pick["over_best_measured"]},
            "best_measured": min(ok, key=lambda row: row["measured_s"]),
            "measure_k": measure_k, "goal_over_best": 1.03,
            "spearman_predicted_vs_measured": _spearman([row["predicted_s"] for row in ok],
                                                        [row["measured_s"] for row in ok]),
            "median_measured_over_predicted": statistics.median(row["measured_over_predicted"] for row in ok),
            "plans": rows}


def _table(record: dict) -> str:
    from tracepp.costs.measure_plans import format_measured

    rows = sorted(record["plans"], key=lambda row: (row["measured_s"] is None, row["measured_s"] or 0))
    pick = record["pick"]
    lines = [format_measured(rows[:15] + [r for r in rows[15:] if r["predicted_rank"] == 1]),
             f"{record['measured']} of {record['priced']} priced plans measured ({record['rounds']} rounds x "
             f"{record['measured_steps']} steps); the tuner's pick (#1 predicted, {pick['plan']['schedule']}, "
             f"{pick['plan']['num_stages']} stages, M={pick['plan']['num_microbatches']}) measured "
             + (f"{pick['measured_s'] * 1000:.1f} ms: #{pick['measured_rank']} of the measured, "
                f"{pick['over_best_measured']:.3f} x the best (goal <= 1.03)" if pick["measured_s"] else "nothing (failed)"),
             "--measure K would apply: " + ", ".join(f"K={k}: #{v['predicted_rank']} predicted, "
                                                     f"{v['over_best_measured']:.3f} x the best"
                                                     for k, v in record["measure_k"].items()),
             f"Spearman (predicted vs measured order): {record['spearman_predicted_vs_measured']:.3f}; median "
             f"measured/predicted {record['median_measured_over_predicted']:.2f}; calibration noise "
             + (f"{record['calibration_noise']:.0%}" if record["calibration_noise"] is not None else "n/a")]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="measure only the N best predicted plans")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--name", default="", help="a suffix for the result file's name (e.g. _contended)")
    parser.add_argument("--keep", default=None, help="keep the work folder here")
    args = parser.parse_args(argv)
    work = args.keep or tempfile.mkdtemp(prefix="tracepp_sweep_")
    os.makedirs(work, exist_ok=True)
    try:
        import torch

        body = sweep(work, args.rounds, args.warmup, args.steps, args.limit, log=lambda text: print(text, flush=True))
        record = {"what": "tune_sweep", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "cores": os.cpu_count(), "loadavg_end": list(os.getloadavg()), **body}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(_table(record))
    write_result(args.out, f"tune_sweep{args.name}", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
