"""``tracepp plan OUT --tune --measure K``: run the K plans the tuner ranks best on this machine, a few steps each,
and set what each measured beside what it was predicted to take; ``--apply`` then takes the fastest measured.

The method is the benchmark suite's (``benchmarks/run.py``, ``benchmarks/paired.py``): *paired rounds*. A round
runs every plan once, each a fresh ``torchrun`` of its folder's ``run.py`` for ``warmup + steps`` steps; the order
of the plans flips every round (1, 2, ..., K, then K, ..., 1), so a spell of load on a shared machine falls on all
of them alike. Each run's first ``warmup`` steps are dropped; a plan's measured step is the median of its measured
steps over all rounds (its per-round medians and the reporting rank's CPU time per step are kept beside it). The
plans are split by the caller (``prepare``: the CLI re-splits the folder's model with each plan, as ``--apply``
would) into folders of their own; nothing here splits or imports the driver.

Plain data in and out: :func:`run_order` (which plan runs when), :func:`summarize` (predicted beside measured, the
ranks by each), :func:`fastest` and :func:`format_measured` take no processes and are tested as such; only
:func:`measure` launches runs.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

DEFAULT_ROUNDS = 2
DEFAULT_WARMUP = 2
DEFAULT_STEPS = 5


@dataclass
class MeasuredPlan:
    """One plan of the tuner's list, run: its 1-based place in the predicted order, the candidate
    (``search.Candidate``), the folder it was split into, and each round's measured steps (the ``--metrics``
    lines after the warm-up) or the error that stopped it."""
    predicted_rank: int
    candidate: object
    folder: str = ""
    processes: int = 0
    rounds: list = field(default_factory=list)  # per round: [{"step_time_s", "cpu_time_s", ...}]
    error: Optional[str] = None

    @property
    def step_times(self) -> list:
        return [line["step_time_s"] for lines in self.rounds for line in lines]

    @property
    def measured_s(self) -> Optional[float]:
        times = self.step_times
        return statistics.median(times) if times and self.error is None else None


def run_order(count: int, rounds: int) -> list:
    """Per round, the order the plans run in (indices into the list): forward in even rounds, backward in odd."""
    forward = list(range(count))
    return [forward if r % 2 == 0 else forward[::-1] for r in range(rounds)]


def _median(values: list) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(plans: list) -> list:
    """Per plan (in predicted order): predicted and measured step (s), measured / predicted, its per-round medians,
    the reporting rank's median CPU time per step, and its rank among the measured plans (1: fastest; None where
    its runs failed)."""
    ok = sorted((p for p in plans if p.measured_s is not None), key=lambda p: p.measured_s)
    measured_rank = {id(p): k for k, p in enumerate(ok, 1)}
    best = ok[0].measured_s if ok else None
    rows = []
    for plan in plans:
        c = plan.candidate
        measured = plan.measured_s
        cpu = [line["cpu_time_s"] for lines in plan.rounds for line in lines if line.get("cpu_time_s") is not None]
        rows.append({"predicted_rank": plan.predicted_rank, "measured_rank": measured_rank.get(id(plan)),
                     "plan": c.to_json(), "predicted_s": c.step_s, "measured_s": measured,
                     "measured_over_predicted": measured / c.step_s if measured and c.step_s else None,
                     "over_best_measured": measured / best if measured and best else None,
                     "round_medians_s": [_median([line["step_time_s"] for line in lines]) for lines in plan.rounds],
                     "cpu_s": _median(cpu), "measured_steps": len(plan.step_times), "processes": plan.processes,
                     "error": plan.error})
    return rows


def fastest(plans: list):
    """The plan with the smallest measured step (None if none ran)."""
    ok = [p for p in plans if p.measured_s is not None]
    return min(ok, key=lambda p: p.measured_s) if ok else None


def format_measured(rows: list) -> str:
    from tabulate import tabulate

    table = []
    for row in rows:
        p = row["plan"]
        layout = f"tp{p['tp']}" + ("+sp" if p["sequence_parallel"] else "") if p["tp"] > 1 else ""
        layout += f" ep{p['ep']}" if p["ep"] > 1 else ""
        layout += f" cp{p['cp']}" if p.get("cp", 1) > 1 else ""
        measured = row["measured_s"]
        table.append([row["predicted_rank"], p["schedule"], p["num_stages"], p["num_microbatches"], layout or "-",
                      ", ".join(p["split_points"]), f"{row['predicted_s'] * 1000:.1f}",
                      f"{measured * 1000:.1f}" if measured else "failed",
                      f"{row['measured_over_predicted']:.2f}" if row["measured_over_predicted"] else "-",
                      row["measured_rank"] or "-",
                      f"{row['over_best_measured']:.3f}" if row["over_best_measured"] else "-"])
    return tabulate(table, headers=["# predicted", "schedule", "stages", "M", "tp/ep/cp", "split points", "predicted ms",
                                    "measured ms", "measured/predicted", "# measured", "/ best measured"],
                    tablefmt="simple", disable_numparse=True)


def _torchrun(nproc: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _run_plan(folder: str, nproc: int, steps: int, metrics: str, timeout: float, threads: Optional[int],
              extra: list) -> Optional[str]:
    """One run of a plan's folder; None, or what went wrong (the output's last lines)."""
    if os.path.exists(metrics):
        os.remove(metrics)
    environment = dict(os.environ)
    if threads:
        environment["OMP_NUM_THREADS"] = str(threads)
    environment.setdefault("PYTHONWARNINGS", "ignore")
    command = _torchrun(nproc) + [os.path.join(folder, "run.py"), "--steps", str(steps), "--metrics", metrics,
                                   "--quiet", *extra]
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=environment)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout:.0f} s: {' '.join(command)}"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: " + "\n".join(proc.stdout.strip().splitlines()[-6:])
    return None


def measure(candidates: list, prepare: Callable, work: str, rounds: int = DEFAULT_ROUNDS,
            warmup: int = DEFAULT_WARMUP, steps: int = DEFAULT_STEPS, timeout: float = 900.0,
            threads: Optional[int] = 1, extra: Optional[list] = None, log=print) -> list:
    """Split each of ``candidates`` (in the tuner's order) with ``prepare(candidate, folder) -> processes`` into
    ``work/plan_<k>``, then run them in paired rounds (:func:`run_order`): ``warmup + steps`` steps a run, the first
    ``warmup`` dropped. A plan that cannot be split or run keeps its error and runs no more; the others go on.
    ``extra``: more arguments for every ``run.py``."""
    plans = []
    for k, candidate in enumerate(candidates, 1):
        plan = MeasuredPlan(k, candidate, os.path.join(work, f"plan_{k}"))
        try:
            plan.processes = prepare(candidate, plan.folder)
        except Exception as error:  # a plan the tuner priced but the split refuses: say so, go on
            plan.error = f"split: {type(error).__name__}: {error}"
        plans.append(plan)
    started = time.perf_counter()
    for round_index, order in enumerate(run_order(len(plans), rounds)):
        for k in order:
            plan = plans[k]
            if plan.error is not None:
                continue
            metrics = os.path.join(work, f"plan_{k + 1}_round{round_index}.jsonl")
            error = _run_plan(plan.folder, plan.processes, warmup + steps, metrics, timeout, threads, list(extra or []))
            lines = []
            if error is None and os.path.exists(metrics):
                with open(metrics) as handle:
                    lines = [json.loads(line) for line in handle if line.strip()][warmup:warmup + steps]
                if len(lines) < steps:
                    error = f"wrote {len(lines)} measured steps of {steps}"
            if error is not None:
                plan.error = f"round {round_index + 1}: {error}"
            else:
                plan.rounds.append(lines)
            log(f"  round {round_index + 1}/{rounds}, plan #{plan.predicted_rank} ({plan.candidate.schedule}, "
                f"{plan.candidate.num_stages} stages, M={plan.candidate.num_microbatches}): "
                + (f"{statistics.median(line['step_time_s'] for line in lines) * 1000:.1f} ms"
                   if error is None else "failed") + f"  [{time.perf_counter() - started:.0f} s]")
    return plans
