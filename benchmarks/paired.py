"""Paired rounds: two or more systems timed in alternation, as the suite (``benchmarks/run.py``) times tracepp and
torch, for the benchmarks that set tracepp against torch's own pieces one dimension at a time
(``benchmarks.tensor_parallel step``, ``benchmarks.expert_parallel step``) and for ``tracepp plan --tune
--measure`` (``tracepp.costs.measure_plans`` uses the same method on the plans it runs).

A round runs every system once, each a fresh ``torchrun`` of ``warmup + measured`` steps; the order flips every
round (A, B, then B, A, ...), so a spell of load on a shared machine lands on both sides. Each run writes one JSON
line per step (``step_time_s``, ``cpu_time_s``, ``loss``) on its reporting rank; the first ``warmup`` steps are
dropped. For each pair (system, peer):

* ``ratio_paired``: the median over rounds of (system's median step in the round / peer's median step in the same
  round): the figure the benchmarks report;
* ``ratio_of_medians``: the median over all the system's measured steps over the peer's (as run.py's tracepp/torch);
* ``cpu_ratio_paired``: the same as the first for the reporting rank's process CPU time per step, which other jobs
  on the machine do not stretch: the one to read on a loaded machine.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def env(threads: int = 1, **extra) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", **extra)
    out["PYTHONPATH"] = root + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    return out


def torchrun(nproc: int, *args: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run_logged(command: list, log_path: str, environment: dict, timeout: float) -> dict:
    """Run ``command`` (output to ``log_path``) within ``timeout`` s: {ok, error, wall_s}; a timeout kills the
    process group."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timeout"
    wall = time.perf_counter() - start
    if code != 0:
        with open(log_path, errors="replace") as log:
            tail = log.read()[-3000:]
        return {"ok": False, "error": f"exit {code} after {wall:.0f}s:\n{tail}", "wall_s": wall}
    return {"ok": True, "error": "", "wall_s": wall}


def read_metrics(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def run_rounds(systems: dict, rounds: int, log=print) -> dict:
    """``systems``: name -> ``run(round_index) -> {"ok", "error", "steps": [metric lines]}`` (plus anything
    else, kept). Runs them in alternating order: {name: [result per round]}."""
    names = list(systems)
    results = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            load = loadavg()
            result = systems[name](round_index)
            result["loadavg_before"] = load
            results[name].append(result)
            times = [line["step_time_s"] for line in result.get("measured", [])]
            log(f"  round {round_index + 1}/{rounds} {name}: "
                + (f"median {statistics.median(times) * 1000:.1f} ms over {len(times)} steps" if times and result["ok"]
                   else f"failed: {result.get('error', '')[-400:]}"))
            if not result["ok"]:
                raise RuntimeError(f"{name} failed in round {round_index + 1}: {result.get('error')}")
    return results


def measured(lines: list, warmup: int, count: int) -> list:
    """The measured steps' lines (after ``warmup``), ``count`` of them."""
    return lines[warmup:warmup + count]


def _median_of(lines: list, key: str):
    values = [line[key] for line in lines if line.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(results: dict) -> dict:
    """Per system: median step and CPU time over all measured steps and per round."""
    out = {}
    for name, runs in results.items():
        steps = [line for run in runs for line in run.get("measured", [])]
        out[name] = {"step_s": _median_of(steps, "step_time_s"), "cpu_s": _median_of(steps, "cpu_time_s"),
                     "round_step_s": [_median_of(run.get("measured", []), "step_time_s") for run in runs],
                     "round_cpu_s": [_median_of(run.get("measured", []), "cpu_time_s") for run in runs],
                     "measured_steps": len(steps), "step_times_s": [line["step_time_s"] for line in steps],
                     "loadavg_before": [run.get("loadavg_before") for run in runs]}
    return out


def ratios(summary: dict, system: str, peer: str) -> dict:
    """system / peer: the median of the per-round ratios (wall and CPU), and the ratio of the overall medians."""
    a, b = summary[system], summary[peer]

    def paired(key):
        pairs = [x / y for x, y in zip(a[key], b[key]) if x and y]
        return (statistics.median(pairs) if pairs else None), pairs

    wall, wall_rounds = paired("round_step_s")
    cpu, cpu_rounds = paired("round_cpu_s")
    return {"ratio_paired": wall, "ratio_per_round": wall_rounds, "cpu_ratio_paired": cpu,
            "cpu_ratio_per_round": cpu_rounds,
            "ratio_of_medians": a["step_s"] / b["step_s"] if a["step_s"] and b["step_s"] else None}


def max_difference(actual: dict, expected: dict) -> tuple:
    """(largest |actual - expected| over every tensor, its key); the keys must be the same."""
    if sorted(actual) != sorted(expected):
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        raise AssertionError(f"the saved parameters differ in keys: missing {missing[:5]}, extra {extra[:5]}")
    worst, where = 0.0, None
    for key in expected:
        diff = float((actual[key].float() - expected[key].float()).abs().max())
        if where is None or diff > worst:
            worst, where = diff, key
    return worst, where


def eager_train(path: str, steps: int, environment: dict = None, lr: float = 0.01) -> dict:
    """The unsplit model of the model file ``path`` trained ``steps`` steps in this process on its ``batch(step)``
    with its ``optimizer`` (SGD at ``lr`` where it has none): its parameters by FQN. ``environment``: variables
    set while the file is imported and run (a size switch)."""
    import torch

    from benchmarks.gpt_model import load_model_file

    environment = environment or {}
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        user = load_model_file(path)
        model = user.model()
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = user.optimizer(params) if hasattr(user, "optimizer") else torch.optim.SGD(params, lr=lr)
        for step in range(steps):
            args, kwargs, target = user.batch(step)
            user.loss_fn(model(*args, **kwargs), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
