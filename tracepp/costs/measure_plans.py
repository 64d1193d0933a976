"""``tracepp plan OUT --tune --measure K``: run the K plans the tuner ranks best on this machine, a few steps each,
and set what each measured beside what it was predicted to take; ``--apply`` then takes the fastest measured.

Two methods. Where the plans can share processes (the same process count, pipeline parallelism alone, and every
plan's largest rank together within half of a rank's memory: :func:`interleavable`), one job holds them all and
runs their steps in turn (:mod:`tracepp.costs.measure_interleaved`: one step of each plan per cycle, the order
flipping every cycle): on a machine whose speed moves within seconds, this is what tells plans a few percent
apart. Otherwise, or if that job fails, the benchmark suite's method (``benchmarks/run.py``,
``benchmarks/paired.py``): *paired rounds*. A round runs every plan once, each a fresh ``torchrun`` of its
folder's ``run.py`` for ``warmup + steps`` steps; the order of the plans flips every round (1, 2, ..., K, then K,
..., 1), so a spell of load on a shared machine falls on all of them alike. Each run's first ``warmup`` steps are
dropped. Either way a plan's measured step is the median of its measured
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
    method: str = "rounds"  # or "interleaved": its steps taken in turn with the other plans' in one job

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
                     "method": plan.method, "error": plan.error})
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
    return _launch(_torchrun(nproc) + [os.path.join(folder, "run.py"), "--steps", str(steps), "--metrics", metrics,
                                        "--quiet", *extra], timeout, threads)


def _launch(command: list, timeout: float, threads: Optional[int]) -> Optional[str]:
    """Run one torchrun job to its end; None, or what went wrong (the output's last lines)."""
    environment = dict(os.environ)
    if threads:
        environment["OMP_NUM_THREADS"] = str(threads)
    environment.setdefault("PYTHONWARNINGS", "ignore")
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=environment)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout:.0f} s: {' '.join(command)}"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: " + "\n".join(proc.stdout.strip().splitlines()[-6:])
    return None


def interleavable(plans: list, memory_bytes: Optional[float]) -> Optional[str]:
    """None where ``plans`` (split, not failed) can share processes (:mod:`tracepp.costs.measure_interleaved`), else
    why not: the same process count, pipeline parallelism only (each plan's own tp, ep, cp or dp meshes side by side
    are not tried), and every plan's largest predicted rank together within half of ``memory_bytes`` (a rank's
    share of the machine's free memory; None: unknown, not checked)."""
    if len(plans) < 2:
        return "one plan"
    counts = sorted({p.processes for p in plans})
    if len(counts) > 1:
        return f"the plans run on different process counts ({', '.join(map(str, counts))})"
    for p in plans:
        c = p.candidate
        if c.tp > 1 or c.ep > 1 or c.cp > 1 or p.processes != len(set(c.stage_to_rank)):
            return f"plan #{p.predicted_rank} is not pipeline parallel alone"
    peaks = [max(p.candidate.peak_memory.values()) for p in plans if p.candidate.peak_memory]
    if memory_bytes and peaks and sum(peaks) > memory_bytes / 2:
        return (f"the plans' largest ranks need {sum(peaks) / 2**30:.1f} GiB together, more than half of the "
                f"{memory_bytes / 2**30:.1f} GiB a rank has")
    return None


def rank_memory_bytes(processes: int) -> Optional[float]:
    """A rank's share of this machine's available memory: the GPU's (every rank on its own) where CUDA is there,
    else the host's free memory over the processes; None where it cannot be read."""
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / max(1, processes)
    except (ValueError, OSError, AttributeError):
        return None


def _measure_interleaved(plans: list, work: str, rounds: int, warmup: int, steps: int, timeout: float,
                         threads: Optional[int], extra: list) -> Optional[str]:
    """Every plan's steps in turn in one job (:mod:`tracepp.costs.measure_interleaved`): ``rounds x steps`` measured
    cycles after ``warmup``, kept as ``rounds`` groups of ``steps`` so each plan's per-round medians read as before.
    None, or what went wrong."""
    prefix = os.path.join(work, "interleaved")
    command = _torchrun(plans[0].processes) + ["-m", "tracepp.costs.measure_interleaved",
                                               *[p.folder for p in plans], "--warmup", str(warmup),
                                               "--steps", str(rounds * steps), "--metrics", prefix, "--", *extra]
    failed = _launch(command, timeout * len(plans), threads)
    if failed is not None:
        return failed
    found = []
    for k in range(1, len(plans) + 1):
        path = f"{prefix}.plan{k}.jsonl"
        if not os.path.exists(path):
            return f"plan {k} wrote no {os.path.basename(path)}"
        with open(path) as handle:
            lines = [json.loads(line) for line in handle if line.strip()]
        if len(lines) < rounds * steps:
            return f"plan {k} wrote {len(lines)} measured steps of {rounds * steps}"
        found.append(lines)
    for plan, lines in zip(plans, found):
        plan.rounds = [lines[r * steps:(r + 1) * steps] for r in range(rounds)]
        plan.method = "interleaved"
    return None


def measure(candidates: list, prepare: Callable, work: str, rounds: int = DEFAULT_ROUNDS,
            warmup: int = DEFAULT_WARMUP, steps: int = DEFAULT_STEPS, timeout: float = 900.0,
            threads: Optional[int] = 1, extra: Optional[list] = None, log=print, interleave: bool = True) -> list:
    """Split each of ``candidates`` (in the tuner's order) with ``prepare(candidate, folder) -> processes`` into
    ``work/plan_<k>``, then measure them: where :func:`interleavable` allows (and ``interleave``), their steps in turn
    in one job, ``warmup`` cycles dropped and ``rounds x steps`` measured (a spell of load falls on every plan within
    a second); otherwise, or if that job fails, in paired rounds of separate runs (:func:`run_order`): ``warmup +
    steps`` steps a run, the first ``warmup`` dropped. A plan that cannot be split or run keeps its error and runs no
    more; the others go on. ``extra``: more arguments for every ``run.py``."""
    plans = []
    for k, candidate in enumerate(candidates, 1):
        plan = MeasuredPlan(k, candidate, os.path.join(work, f"plan_{k}"))
        try:
            plan.processes = prepare(candidate, plan.folder)
        except Exception as error:  # a plan the tuner priced but the split refuses: say so, go on
            plan.error = f"split: {type(error).__name__}: {error}"
        plans.append(plan)
    ready = [p for p in plans if p.error is None]
    why = interleavable(ready, rank_memory_bytes(ready[0].processes) if ready else None) if interleave else "asked"
    if why is None:
        log(f"  the {len(ready)} plans' steps in turn in one job: {warmup} warm-up + {rounds * steps} measured cycles")
        started = time.perf_counter()
        failed = _measure_interleaved(ready, work, rounds, warmup, steps, timeout, threads, list(extra or []))
        if failed is None:
            log(f"  done [{time.perf_counter() - started:.0f} s]")
            return plans
        log(f"  measuring the plans in one job failed ({failed}); measuring them in rounds of their own runs")
    elif interleave:
        log(f"  in rounds of separate runs: {why}")
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
