"""Benchmark suite: is tracepp faster than torch.distributed.pipelining, and how close to its schedule's best?

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--out benchmarks/results]

Run from the repository root. For every case (GPT size x ranks x schedule x microbatch count, and one
mixture-of-experts case: a Hugging Face Mixtral, 8 experts top-2, 1F1B on 2 ranks) the same model file
(benchmarks/gpt_model.py, untied head), split at the same block FQNs, is trained by

* ``tracepp``: ``split_model`` then ``torchrun`` on the generated ``run.py`` (its own ``--metrics`` step time,
  on the last stage's rank);
* ``torch``: ``torch.distributed.pipelining`` (``pipeline`` + ``SplitPoint.BEGINNING`` + ``build_stage`` +
  the matching ``Schedule*``), ``benchmarks/torch_worker.py``, timed the same way;
* ``eager``: the unsplit model in one process, full batch (``benchmarks/eager_worker.py``);
* ``ideal``: ``codegen.simulate`` of tracepp's own plan with per-(stage, kind) compute times measured in one
  process, comms free, plus the SGD step (``benchmarks/stage_times.py``): each stage's own function
  with plain autograd (``tracepp.costs.measure_stages``: F, B, I = input-gradient half, W = B - I), not tracepp's
  executor, so ideal / tracepp shows all of the runtime's overhead, the zero-bubble split's included. On CPU
  the costs are measured inside each tracepp run: after its measured steps come ``--paired-steps`` more, and
  before and after each of them every rank times its own stages, all ranks at once between two barriers
  (``benchmarks/tracepp_worker.py``), so a cost is measured under the run's load (the ranks share the cache and
  the memory bus: a stage is 3 - 7% slower with the other core busy on the project's VM) a second from the step
  it prices. The ideal is the median of the rounds' (each round priced with its run's costs; ``efficiency_paired``:
  the median of each round's ideal / tracepp), and ``efficiency_stepwise`` the median over every paired step of
  its ideal (priced with the costs measured around it) over its measured time: on a machine whose speed moves
  10 - 40% within minutes, the one ratio whose two sides see the same spell;
* ``floor`` (``--floor``, CPU): tracepp's plan run by the thinnest loop (``benchmarks/floor_worker.py``: the same
  stage functions with plain autograd, each rank's actions in the plan's order, tracepp's shared-memory messages,
  one all-reduce per step, no runtime), next to tracepp in every round and with its own paired steps: how far from
  the ideal a pipeline on this machine gets without tracepp's runtime (``floor_efficiency_stepwise``), and
  ``tracepp_over_floor``, the median over rounds of tracepp's round over the floor's;
* ``predicted``: the calibrated simulator (``tracepp.costs.model``, ``benchmarks/predict.py``): the same plan with
  the stage costs times the runtime factors (tracepp's executor over the plain stage functions, per kind, measured
  with the ideal's costs), the ping-pong's latency and bandwidth on every message, and the one overhead number of
  ``tracepp calibrate`` (``FIT_MODE``: a rank time per action), the median of its fits to the *other* cases' measured
  steps; printed next to the measured median with the error, and ``error_stepwise``: the median error over the
  paired steps, each predicted with the costs measured around it.

``--quick`` also benchmarks the tuner (``tracepp plan --tune``): calibrated from the suite's two-stage cases, it
picks a plan for the same model and ranks; the pick is split, run and measured in alternation with the best
hand-picked case, and both are printed.

Runs of the systems alternate (tracepp, torch, eager, then torch, tracepp, eager, ...), each run drops its
warm-up steps, and the step time reported is the median of all measured steps (``cpu_time_s``: the median
process CPU time per step of the same rank, which other jobs on the machine do not stretch; the 1-minute load
average before each run is kept with it). Every process runs with
``--threads`` intra-op threads (default 1, which is what torchrun sets for several processes per node).
Peak memory per rank: see benchmarks/memory.py (CPU: peak live bytes of torch's CPU allocator during one
untimed step after the timed ones, relative to the live bytes at its start, from torch.profiler's memory
events; CUDA: max allocated over that step). Every run ends with those ``MEMORY_STEPS`` untimed steps. Results: a table on stdout, ``OUT/<date>_<device>.json``, and ``OUT/<date>_<device>.png`` (the
ratios; needs matplotlib: ``pip install -e ".[bench]"``).

``--device cuda`` runs the single-GPU variants instead: bf16 weights, one rank holding every stage
(interleaved schedules), tracepp vs eager on the GPU, plus the simulator's prediction for an R-GPU pipeline
from stage times measured on this GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.gpt_model import GPTConfig, MixtralConfig, write_model_file
from benchmarks.memory import MEMORY_STEPS, read_memory
from benchmarks.predict import loadavg, predict_cases, stepwise_pairs, suite_calibration

SYSTEMS = ("tracepp", "torch", "eager")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "interleaved-zb": 2}


@dataclass(frozen=True)
class Case:
    config: object  # GPTConfig or MixtralConfig
    ranks: int
    schedule: str
    microbatches: int
    stages: int  # total stages of the split
    run_ranks: int  # processes actually launched (1 for the single-GPU variants)

    @property
    def key(self) -> str:
        return f"{self.config.name}_r{self.ranks}_{self.schedule}_m{self.microbatches}"


@dataclass
class Settings:
    rounds: int
    warmup: int
    measured: int
    timeout: float
    paired: int = 0  # CPU: steps after the measured ones, each bracketed by in-run stage costs (tracepp_worker)
    floor: bool = False  # CPU: also run benchmarks/floor_worker.py (tracepp's plan by the thinnest loop)


# ----------------------------------------------------------------------------------------------------
# the suites

# a mixture-of-experts case (Hugging Face Mixtral, grouped-matmul experts): its efficiency and its prediction, with
# the per-action overhead fitted on the suite's other cases (leave one out), i.e. on another model
MIXTRAL_CASE = Case(MixtralConfig(d_model=128, n_layer=8, batch=32, seq=32), 2, "1f1b", 4, 2, 2)


def cpu_cases(quick: bool) -> list:
    if quick:
        config = GPTConfig(d_model=128, n_layer=8, batch=32, seq=32)
        plan = [("gpipe", 4), ("1f1b", 32), ("interleaved-1f1b", 8), ("interleaved-zb", 8)]
        return [Case(config, 2, s, m, 2 * STAGES_PER_RANK[s], 2) for s, m in plan] + [MIXTRAL_CASE]
    cases = [MIXTRAL_CASE]
    for d_model in (128, 256, 512):
        config = GPTConfig(d_model=d_model, n_layer=8, n_head=max(4, d_model // 64), batch=32, seq=32)
        for ranks in (2, 4):
            for schedule in STAGES_PER_RANK:
                for microbatches in (4, 8, 32):  # 8 samples per microbatch (compute) .. 1 sample (overhead)
                    cases.append(Case(config, ranks, schedule, microbatches,
                                      ranks * STAGES_PER_RANK[schedule], ranks))
    return cases


def cuda_cases(quick: bool) -> list:
    """One GPU: one rank holds every stage; the plan is an interleaved schedule over 1 rank."""
    sizes = (512,) if quick else (512, 1024, 2048)
    cases = []
    for d_model in sizes:
        config = GPTConfig(d_model=d_model, n_layer=8, n_head=d_model // 64, vocab=8192, seq=256, batch=32,
                           dtype="bfloat16")
        for schedule in ("interleaved-1f1b", "interleaved-zb"):
            for microbatches in ((4, 32) if quick else (2, 4, 8, 32)):
                # predicted for ranks=4 (the R-GPU pipeline); run on 1 GPU holding all 4 stages
                cases.append(Case(config, 4, schedule, microbatches, 4, 1))
    return cases


# ----------------------------------------------------------------------------------------------------
# running the systems

def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONWARNINGS"] = "ignore"
    root = os.getcwd()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _torchrun(nproc: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _run(cmd: list, log_path: str, env: dict, timeout: float) -> tuple:
    """Run ``cmd`` (its output to ``log_path``) within ``timeout`` seconds: (ok, error, wall seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_tree(proc)
            code = "timeout"
    wall = time.perf_counter() - start
    if code != 0:
        with open(log_path) as log:
            tail = log.read()[-1500:]
        return False, f"exit {code} after {wall:.0f}s: {tail.strip().splitlines()[-1] if tail.strip() else ''}", wall
    return True, "", wall


def _descendants(pid: int) -> list:
    """Process ids below ``pid`` (from /proc; empty where there is no /proc)."""
    children: dict = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """A run past its time: SIGTERM to the launcher (torchrun then stops its workers), SIGKILL to whatever of
    the process tree is left after ``grace_s``. torchrun starts each worker in a session of its own, so the
    workers are found by parent id, before the launcher goes."""
    tree = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid] + tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


_HICCUPS = ("EADDRINUSE", "address already in use", "RendezvousConnectionError", "DistNetworkError")


def _launcher_hiccup(log_path: str) -> bool:
    with open(log_path, errors="replace") as handle:
        text = handle.read()
    return any(marker in text for marker in _HICCUPS)


def _read_steps(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def run_system(system: str, case: Case, model_path: str, out_dir: str, work: str, round_index: int,
               settings: Settings, device: str, threads: int, run_args: tuple = (), tag: str = "") -> dict:
    """One run of ``system`` on ``case``; ``run_args``: more flags for tracepp's run.py or the torch worker
    (``tag`` names its files)."""
    tag = f"{system}{tag}_{case.key}_round{round_index}"
    metrics = os.path.join(work, tag + ".jsonl")
    memory_dir = os.path.join(work, tag + "_mem")
    log = os.path.join(work, tag + ".log")
    paired = settings.paired + 1 if system in ("tracepp", "floor") and settings.paired and device == "cpu" else 0
    first_paired = settings.warmup + settings.measured
    steps = first_paired + paired + MEMORY_STEPS  # the last ones: memory window, never timed
    paired_prefix = os.path.join(work, tag + "_paired")
    if system == "tracepp":
        extra = (["--paired-steps", str(paired), "--paired-from", str(first_paired), "--paired-costs", paired_prefix]
                 if paired else [])
        cmd = _torchrun(case.run_ranks) + ["-m", "benchmarks.tracepp_worker", out_dir, "--memory-dir", memory_dir,
                                           *extra, "--", "--steps", str(steps), "--metrics", metrics, "--quiet",
                                           "--timeout", str(settings.timeout), *run_args]
    elif system == "floor":
        extra = (["--paired-steps", str(paired), "--paired-from", str(first_paired), "--paired-costs", paired_prefix]
                 if paired else [])
        cmd = _torchrun(case.run_ranks) + ["-m", "benchmarks.floor_worker", out_dir, "--steps", str(steps),
                                           "--metrics", metrics, "--timeout", str(settings.timeout), *extra]
    elif system == "torch":
        cmd = _torchrun(case.run_ranks) + ["-m", "benchmarks.torch_worker", "--model-file", model_path,
                                           "--schedule", case.schedule, "--microbatches", str(case.microbatches),
                                           "--steps", str(steps), "--metrics", metrics, "--memory-dir", memory_dir,
                                           "--device", device, *run_args]
    else:
        cmd = [sys.executable, "-m", "benchmarks.eager_worker", "--model-file", model_path, "--steps", str(steps),
               "--metrics", metrics, "--memory-dir", memory_dir, "--device", device]
    load_before = (loadavg() or [None])[0]  # the 1-minute load average before this run (it adds its processes)
    ok, error, wall = _run(cmd, log, _env(threads), settings.timeout)
    retried = False
    if not ok and _launcher_hiccup(log):  # a port taken by another job on the machine: launch once more
        shutil.rmtree(memory_dir, ignore_errors=True)
        if os.path.exists(metrics):
            os.remove(metrics)
        ok, error, wall = _run(cmd, log, _env(threads), settings.timeout)
        retried = True
    lines = _read_steps(metrics)
    result = {"ok": ok and len(lines) == steps, "error": error, "wall_s": wall, "log": log, "retried": retried,
              "step_times": [line["step_time_s"] for line in lines[settings.warmup:settings.warmup + settings.measured]],
              "cpu_times": [line["cpu_time_s"] for line in lines[settings.warmup:settings.warmup + settings.measured]
                            if "cpu_time_s" in line],
              "faults": [line["minor_faults"] for line in lines[settings.warmup:settings.warmup + settings.measured]
                         if "minor_faults" in line],
              "loadavg": load_before,
              "losses": [line["loss"] for line in lines], "memory": read_memory(memory_dir)}
    if paired:
        result["paired"] = _read_paired(paired_prefix, case.run_ranks, out_dir,
                                        [line["step_time_s"] for line in lines[first_paired:first_paired + paired]])
    if ok and len(lines) != steps:
        result["error"] = f"wrote {len(lines)} metric lines, expected {steps}"
    return result


def _read_paired(prefix: str, ranks: int, out_dir: str, step_times: list) -> dict:
    """A tracepp run's in-run stage costs (``tracepp.costs.measure_in_run.read_paired``) with its paired steps."""
    from tracepp.costs.measure_in_run import read_paired

    with open(os.path.join(out_dir, "manifest.json")) as handle:
        stages = len(json.load(handle)["stages"])
    return read_paired(prefix, ranks, stages, step_times)


def _merge(runs: list, tokens: int) -> dict:
    good = [r for r in runs if r["ok"]]
    if not good:
        return {"status": "failed", "error": runs[0]["error"] if runs else "not run", "log": runs[0]["log"] if runs else None}
    times = [t for r in good for t in r["step_times"]]
    step = statistics.median(times)
    cpu_times = [t for r in good for t in r.get("cpu_times", [])]
    faults = [f for r in good for f in r.get("faults", [])]
    per_rank: dict = {}
    rss_per_rank: dict = {}
    method = rss_method = None
    for r in good:
        for m in r["memory"]:
            if m.get("peak_mb") is not None:
                per_rank[m["rank"]] = max(per_rank.get(m["rank"], 0.0), m["peak_mb"])
            if m.get("rss_growth_mb") is not None:
                rss_per_rank[m["rank"]] = max(rss_per_rank.get(m["rank"], 0.0), m["rss_growth_mb"])
            method = m["method"]
            rss_method = m.get("rss_method") or rss_method
    return {"status": "ok", "step_time_s": step, "tokens_per_s": tokens / step, "measured_steps": len(times),
            "round_step_s": [statistics.median(r["step_times"]) if r["ok"] and r["step_times"] else None
                             for r in runs],
            "cpu_time_s": statistics.median(cpu_times) if cpu_times else None,
            "minor_faults_per_step": statistics.median(faults) if faults else None,  # tracepp's reporting rank
            "loadavg_1min": [r.get("loadavg") for r in good],
            "runs": len(good), "step_times_s": times, "min_step_time_s": min(times),
            "peak_mem_mb_per_rank": [per_rank[k] for k in sorted(per_rank)],
            "peak_mem_mb": max(per_rank.values()) if per_rank else None, "memory_method": method,
            "rss_growth_mb_per_rank": [rss_per_rank[k] for k in sorted(rss_per_rank)],
            "rss_growth_mb": max(rss_per_rank.values()) if rss_per_rank else None, "rss_method": rss_method,
            "losses_first_run": good[0]["losses"]}


# ----------------------------------------------------------------------------------------------------
# the suite

def run_suite(cases: list, settings: Settings, device: str, threads: int, work: str,
              log=print, tune: bool = False) -> dict:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    started = time.perf_counter()
    results, eager_runs, folders = [], {}, {}
    comm = _comm(cases, device, threads, settings, log)
    for number, case in enumerate(cases, 1):
        config = case.config
        tokens = config.tokens_per_step
        case_dir = os.path.join(work, case.key)
        model_path = write_model_file(os.path.join(case_dir, "model.py"), config, case.stages)
        out_dir = os.path.join(case_dir, "tracepp_out")
        entry = {"case": case.key, "model": config.to_json(), "ranks": case.ranks, "run_ranks": case.run_ranks,
                 "schedule": case.schedule, "microbatches": case.microbatches, "stages": case.stages,
                 "microbatch_size": config.batch // case.microbatches, "tokens_per_step": tokens,
                 "split_points": config.split_points(case.stages), "out_dir": out_dir, "loadavg": loadavg()}
        log(f"[{number}/{len(cases)}] {case.key} ({time.perf_counter() - started:.0f}s)")
        try:
            split_model(model_path, out_dir, num_stages=case.stages,
                        schedule=case.schedule, num_microbatches=case.microbatches,
                        split_points=config.split_points(case.stages), layout=Layout(pp=case.run_ranks))
            split_error = None
        except Exception as error:  # a case tracepp cannot plan is reported, not fatal
            split_error = f"{type(error).__name__}: {error}"
        systems = ["tracepp", "torch", "eager"] if device == "cpu" else ["tracepp", "eager"]
        if device == "cpu" and settings.floor:
            systems.insert(1, "floor")  # next to tracepp in every round: the pair whose ratio is read
        runs = {s: [] for s in systems}
        round_costs, paired_runs, floor_paired = [], [], []
        for round_index in range(settings.rounds):
            order = systems[:-1][::-1 if round_index % 2 else 1] + systems[-1:]
            for system in order:
                if system in ("tracepp", "floor") and split_error:
                    continue
                if system == "eager" and len(eager_runs.get(config, [])) >= settings.rounds:
                    continue  # eager does not depend on the schedule: measured with the config's first case
                result = run_system(system, case, model_path, out_dir, case_dir, round_index, settings, device,
                                    threads)
                if device == "cpu" and system == "tracepp":
                    # the ideal's costs (CPU): measured by the run's own ranks between its paired steps; the
                    # round's costs are their per-key median (the run's measured steps a few seconds before)
                    found = (result.get("paired") or {}).get("rounds") or []
                    round_costs.append(_median_costs(found))
                    paired_runs.append(result.get("paired"))
                if system == "floor":
                    floor_paired.append(result.get("paired"))
                (eager_runs.setdefault(config, []) if system == "eager" else runs[system]).append(result)
        entry["round_costs"] = round_costs
        entry["paired_runs"] = paired_runs
        entry["tracepp"] = (_merge(runs["tracepp"], tokens) if not split_error
                            else {"status": "unsupported", "error": split_error})
        if "torch" in runs:
            entry["torch"] = _merge(runs["torch"], tokens)
        if "floor" in runs and not split_error:
            entry["floor"] = dict(_merge(runs["floor"], tokens), paired_runs=floor_paired)
        entry["eager"] = _merge(eager_runs.get(config, []), tokens)
        if not split_error:
            folders[out_dir] = entry
        results.append(entry)
    # ideal: stage times of every tracepp plan, one process for all of them
    if folders:
        times_json = os.path.join(work, "stage_times.json")
        log(f"stage times of {len(folders)} plans ({time.perf_counter() - started:.0f}s)")
        cmd = [sys.executable, "-m", "benchmarks.stage_times", *folders, "--json", times_json, "--device", device,
               "--rounds", str(max(3, settings.rounds + 1))]
        if device == "cuda":
            cmd += ["--predict-ranks", str(cases[0].ranks)]
        ok, error, _ = _run(cmd, os.path.join(work, "stage_times.log"), _env(threads), settings.timeout * 4)
        measured = json.load(open(times_json)) if ok else {}
        for out_dir, entry in folders.items():
            if out_dir in measured:
                entry["ideal"] = dict(measured[out_dir], status="ok", step_time_s=measured[out_dir]["ideal_step_s"],
                                      tokens_per_s=entry["tokens_per_step"] / measured[out_dir]["ideal_step_s"])
                entry["optimizer_stage_s"] = measured[out_dir]["optimizer_stage_s"]
                _ideal_from_round_costs(out_dir, entry, measured[out_dir])
            else:
                entry["ideal"] = {"status": "failed", "error": error}
    if device == "cpu" and folders:
        log(f"predictions of the calibrated simulator ({time.perf_counter() - started:.0f}s)")
        predict_cases(list(folders.values()), comm, log=log)
    tuned = None
    if tune and device == "cpu" and folders:
        tuned = tune_benchmark(list(folders.values()), comm, settings, threads, work, log)
    for entry in results:
        entry.setdefault("ideal", {"status": "unsupported", "error": entry["tracepp"].get("error")})
        _derive(entry)
    return {"results": results, "elapsed_s": time.perf_counter() - started, "comm": comm, "tuner": tuned}


def _comm(cases: list, device: str, threads: int, settings: Settings, log) -> dict:
    """The ping-pong of tracepp.costs.measure_comm between the suite's ranks (CPU suites; one rank count)."""
    from tracepp.costs.calibrate import measure_comm

    ranks = sorted({case.run_ranks for case in cases if case.run_ranks > 1})
    if device != "cpu" or not ranks:
        return {}
    try:
        comm = measure_comm(ranks[-1], timeout=settings.timeout, threads=threads)
    except RuntimeError as error:
        log(f"ping-pong failed, comms priced free: {error}")
        return {}
    for key, value in sorted(comm.get("pairs", {}).items()):
        bandwidth = value.get("bandwidth_bytes_per_s")
        log(f"ping-pong ranks {key}: latency {value['latency_s'] * 1e6:.1f} us, bandwidth "
            + (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "n/a"))
    return comm


def _ideal_from_round_costs(out_dir: str, entry: dict, measured: dict) -> None:
    """Price the ideal and the prediction with the plain-autograd stage costs measured inside each round's tracepp
    run (``round_costs``: the per-key median of its paired rounds), so the ideal and the measured step see the same
    spells of a shared machine (stage costs measured a few minutes apart differ by up to 40% on it). The ideal is
    the median over rounds of each round's simulated step; ``compute_costs`` (the predictor's) the per-key median;
    ``efficiency_stepwise`` the median over the paired steps of each one's ideal / measured. Without round costs
    (no paired steps, or every in-run measurement failed) stage_times' plain costs, measured in one process after
    the suite's runs, are used and ``costs_method`` says why."""
    from benchmarks.stage_times import ideal_step

    raw = entry.pop("round_costs", [])
    rounds = [costs for costs in raw if costs]
    ideal = entry["ideal"]
    ideal["step_time_s_stage_times"] = ideal["step_time_s"]
    if not rounds:  # no paired steps (--paired-steps 0), or every in-run measurement failed
        entry["compute_costs"] = dict(measured["costs"])
        entry["costs_source"] = "plain autograd in one process after the suite's runs (benchmarks/stage_times.py)"
        why = ("no paired steps" if not entry.get("paired_runs") or not any(entry["paired_runs"]) else
               "the in-run measurement failed: " + "; ".join(error for paired in entry["paired_runs"] if paired
                                                             for error in paired.get("errors", [])))
        ideal["costs_method"] = f"{entry['costs_source']}; {why}"
        return
    with open(os.path.join(out_dir, "manifest.json")) as handle:
        manifest = json.load(handle)
    by_round = [ideal_step(manifest, costs, entry["optimizer_stage_s"])["ideal_step_s"] if costs else None
                for costs in raw]
    steps = [s for s in by_round if s is not None]
    entry["compute_costs"] = {key: statistics.median(costs[key] for costs in rounds) for key in rounds[0]}
    entry["costs_source"] = "plain autograd (tracepp.costs.measure_stages)"
    step = statistics.median(steps)
    ideal.update(step_time_s=step, ideal_step_s=step, round_step_s=by_round, round_costs=raw,
                 costs_stage_times=ideal["costs"],
                 costs={f"{key[:-1]},{key[-1]}": value for key, value in entry["compute_costs"].items()},
                 tokens_per_s=entry["tokens_per_step"] / step,
                 costs_method="plain autograd per stage (tracepp.costs.measure_stages), W = B - I, measured by each tracepp "
                              "run's own ranks between its paired steps; the ideal is the median of the rounds' "
                              "simulated steps")
    paired = [i / t for i, t in zip(by_round, (entry.get("tracepp") or {}).get("round_step_s") or []) if i and t]
    if paired:  # ideal / tracepp of each round, its runs and its costs minutes apart at most
        entry["efficiency_paired"] = statistics.median(paired)
    # ideal / tracepp of every paired step, priced with the costs its own ranks measured around it
    stepwise = [[ideal_step(manifest, costs, entry["optimizer_stage_s"])["ideal_step_s"], step]
                for costs, step in stepwise_pairs(entry)]
    if stepwise:
        ideal["stepwise"] = stepwise
        entry["efficiency_stepwise"] = statistics.median(i / t for i, t in stepwise)
    floor = entry.get("floor") or {}
    if floor.get("paired_runs"):  # the same for the floor loop's paired steps, priced with its own ranks' costs
        from tracepp.costs.measure_in_run import bracketed

        stepwise = [[ideal_step(manifest, costs, entry["optimizer_stage_s"])["ideal_step_s"], step]
                    for paired in floor["paired_runs"] for costs, step in bracketed(paired)]
        if stepwise:
            floor["stepwise"] = stepwise
            entry["floor_efficiency_stepwise"] = statistics.median(i / t for i, t in stepwise)


def _median_costs(measurements: list):
    """The per-key median of the stage-cost measurements that succeeded (None if none did): a round's costs from
    its run's paired rounds."""
    from tracepp.costs.model import median_costs

    found = [costs for costs in measurements if costs]
    return median_costs(found) if found else None


def tune_benchmark(entries: list, comm: dict, settings: Settings, threads: int, work: str, log) -> dict:
    """The tuner on the suite's model (calibrated from its cases), its pick run against the best hand-picked case."""
    from tracepp.resplit import resplit
    from tracepp.codegen.manifest import load_manifest
    from tracepp.costs.search import tune

    model = entries[0]["model"]["name"]  # the suite's model (the GPT): the tuner searches one model's plans
    measured = [e for e in entries if (e.get("tracepp") or {}).get("status") == "ok" and e.get("prediction")
                and e["model"]["name"] == model]
    if not measured:
        return {"status": "skipped", "error": "no measured case"}
    from tracepp.costs.calibrate import FIT_MODE, overhead_of

    values = [e["prediction"]["fitted_overhead_s"] for e in measured if e["prediction"]["fitted_overhead_mode"] == FIT_MODE]
    overhead = overhead_of(FIT_MODE, statistics.median(values) if values else 0.0)
    calibration, reference = suite_calibration(measured, comm, overhead)
    manifest = load_manifest(reference)
    started = time.perf_counter()
    kept, _dropped, _failed = tune(manifest, calibration, optimizer_bytes_per_param=0)
    tune_s = time.perf_counter() - started
    best = kept[0]
    log(f"tuner ({tune_s:.1f}s, {len(kept)} plans priced): {best.schedule}, {best.num_stages} stages, "
        f"M={best.num_microbatches}, split {','.join(best.split_points)}: predicted {best.step_s * 1000:.1f} ms")
    hand = min(measured, key=lambda e: e["tracepp"]["step_time_s"])
    tuned_dir = os.path.join(work, "tuned", "tracepp_out")
    os.makedirs(os.path.dirname(tuned_dir), exist_ok=True)
    resplit(manifest, tuned_dir, schedule=best.schedule, num_stages=best.num_stages,
            num_microbatches=best.num_microbatches, split_points=list(best.split_points))
    config = GPTConfig(**{k: v for k, v in hand["model"].items() if k in GPTConfig.__dataclass_fields__})
    cases = {"tuned": Case(config, hand["ranks"], best.schedule, best.num_microbatches, best.num_stages,
                           hand["run_ranks"]),
             "hand": Case(config, hand["ranks"], hand["schedule"], hand["microbatches"], hand["stages"],
                          hand["run_ranks"])}
    folders = {"tuned": tuned_dir, "hand": hand["out_dir"]}
    runs = {"tuned": [], "hand": []}
    settings = dataclasses.replace(settings, paired=0)  # step times only: no in-run stage costs
    for round_index in range(settings.rounds):
        for name in (("tuned", "hand") if round_index % 2 == 0 else ("hand", "tuned")):
            case_dir = os.path.dirname(folders[name])
            runs[name].append(run_system("tracepp", cases[name], "", folders[name], case_dir, 100 + round_index,
                                         settings, "cpu", threads))
    tokens = hand["tokens_per_step"]
    merged = {name: _merge(runs[name], tokens) for name in runs}
    result = {"status": "ok", "tune_s": tune_s, "pick": best.to_json(), "top": [c.to_json() for c in kept[:5]],
              "hand_picked": hand["case"], "hand_suite_step_s": hand["tracepp"]["step_time_s"],
              "tuned_step_s": merged["tuned"].get("step_time_s"), "hand_step_s": merged["hand"].get("step_time_s"),
              "overhead": overhead, "loadavg": loadavg()}
    if result["tuned_step_s"] and result["hand_step_s"]:
        result["tuned_over_hand"] = result["tuned_step_s"] / result["hand_step_s"]
    log(f"tuner's pick measured {_ms(result['tuned_step_s'])} ms against the best hand-picked case {hand['case']} "
        f"{_ms(result['hand_step_s'])} ms (in the suite: {_ms(hand['tracepp']['step_time_s'])} ms)")
    return result


def _time(entry: dict, system: str):
    part = entry.get(system) or {}
    return part.get("step_time_s") if part.get("status") == "ok" else None


def _derive(entry: dict) -> None:
    tp, th, ideal, eager = (_time(entry, s) for s in ("tracepp", "torch", "ideal", "eager"))
    entry["ratio_tracepp_over_torch"] = tp / th if tp and th else None
    # the last stage's rank's process CPU time per step: what the runtimes spend, unstretched by other jobs
    cpu_tp, cpu_th = ((entry.get(s) or {}).get("cpu_time_s") for s in ("tracepp", "torch"))
    entry["cpu_ratio_tracepp_over_torch"] = cpu_tp / cpu_th if cpu_tp and cpu_th else None
    entry["efficiency"] = ideal / tp if tp and ideal else None  # ideal/tracepp: 1.0 = the schedule's best
    # ideal/torch: the lowest tracepp/torch any runtime running these stage functions could reach (plain autograd,
    # no overhead, free comms): a tracepp/torch goal below it needs cheaper compute, not a leaner runtime
    entry["ideal_over_torch"] = ideal / th if th and ideal else None
    entry["speedup_over_eager"] = eager / tp if tp and eager else None
    floor = entry.get("floor") or {}
    if floor.get("status") == "ok" and tp:
        # tracepp / floor: the median over rounds of the two runs of one round (adjacent in it), and the losses
        rounds = [t / f for t, f in zip(entry["tracepp"].get("round_step_s") or [], floor.get("round_step_s") or [])
                  if t and f]
        entry["tracepp_over_floor"] = statistics.median(rounds) if rounds else None
        entry["floor_efficiency"] = ideal / floor["step_time_s"] if ideal else None
        a, b = entry["tracepp"]["losses_first_run"], floor["losses_first_run"]
        entry["floor_same_losses"] = _same_losses(a, b, 1e-4)  # the same stage functions: closer than torch's
    if entry["tracepp"].get("status") == "ok" and entry.get("torch", {}).get("status") == "ok":
        a, b = entry["tracepp"]["losses_first_run"], entry["torch"]["losses_first_run"]
        # tracepp's CPU runs go on for their paired steps; torch's run ends after its memory steps
        entry["same_losses"] = bool(a and b and min(len(a), len(b)) >= len(b) - MEMORY_STEPS
                                    and _same_losses(a, b, 1e-3))


def _same_losses(a: list, b: list, tolerance: float) -> bool:
    """Whether two runs' per-step losses agree (relative ``tolerance``) over the steps both ran."""
    common = min(len(a), len(b))
    return bool(common and all(abs(x - y) <= tolerance * max(1.0, abs(y)) for x, y in zip(a[:common], b[:common])))


# ----------------------------------------------------------------------------------------------------
# output

def _ms(value):
    return f"{value * 1000:.1f}" if value else "-"


def _fmt(value, spec):
    return format(value, spec) if value is not None else "-"


def format_table(report: dict) -> str:
    from tabulate import tabulate

    cuda = report["device"] == "cuda"
    rows = []
    for e in report["results"]:
        if cuda:
            rows.append([e["model"]["name"], f"1 (plan {e['ranks']})", e["schedule"], e["microbatches"],
                         _ms(_time(e, "tracepp")), _ms(_time(e, "eager")), _ms(_time(e, "ideal")),
                         _ms((e.get("prediction") or {}).get("step_time_s")),
                         _fmt(e["tracepp"].get("tokens_per_s"), ",.0f"), _fmt(e["efficiency"], ".2f"),
                         _fmt(e["tracepp"].get("peak_mem_mb"), ".0f"), _fmt(e["eager"].get("peak_mem_mb"), ".0f")])
        else:
            prediction = e.get("prediction") or {}
            rows.append([e["model"]["name"], e["ranks"], e["schedule"], e["microbatches"], e["microbatch_size"],
                         _ms(_time(e, "tracepp")), _ms(prediction.get("step_time_s")),
                         _fmt(prediction.get("error") * 100 if prediction.get("error") is not None else None, "+.1f"),
                         _fmt(prediction.get("noise") * 100 if prediction.get("noise") is not None else None, ".0f"),
                         _fmt(prediction.get("error_stepwise") * 100
                              if prediction.get("error_stepwise") is not None else None, "+.1f"),
                         _ms(_time(e, "torch")), _ms(_time(e, "eager")),
                         _ms(_time(e, "ideal")), _fmt(e["tracepp"].get("tokens_per_s"), ",.0f"),
                         _fmt(e["torch"].get("tokens_per_s"), ",.0f"), _fmt(e["ratio_tracepp_over_torch"], ".2f"),
                         _fmt(e.get("cpu_ratio_tracepp_over_torch"), ".2f"), _fmt(e.get("ideal_over_torch"), ".2f"),
                         _fmt(e["efficiency"], ".2f"),
                         _fmt(e.get("efficiency_stepwise"), ".2f"), _fmt(e["tracepp"].get("peak_mem_mb"), ".0f"),
                         _fmt(e["torch"].get("peak_mem_mb"), ".0f"), _fmt(e["eager"].get("peak_mem_mb"), ".0f")])
    if cuda:
        headers = ["model", "GPUs", "schedule", "M", "tracepp ms", "eager ms", "ideal ms", "predicted R-GPU ms",
                   "tracepp tok/s", "ideal/tracepp", "mem tracepp MB", "mem eager MB"]
    else:
        headers = ["model", "R", "schedule", "M", "mb size", "tracepp ms", "predicted ms", "error %", "noise %",
                   "step error %", "torch ms", "eager ms", "ideal ms", "tracepp tok/s", "torch tok/s", "tracepp/torch",
                   "cpu tracepp/torch", "ideal/torch", "ideal/tracepp", "step ideal/tracepp", "mem tracepp MB", "mem torch MB",
                   "mem eager MB"]
    text = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    notes = [f"step time: median of measured steps (warm-up dropped) over alternating runs; tokens/s = "
             f"batch*seq / step time; ideal = simulated plan with each stage's plain-autograd F/B/I/W "
             f"(tracepp.costs.measure_stages, measured by each tracepp run's ranks between its paired steps; median of the "
             f"rounds), comms free, + SGD step; "
             f"cpu tracepp/torch: process CPU time per step of the "
             f"last stage's rank",
             "predicted = calibrated simulator: stage costs x runtime factors, ping-pong latency/bandwidth per "
             "message, the overhead (tracepp calibrate's fit: a rank time per action by default) "
             "fitted to the other cases (leave one out); error = (predicted - tracepp) / tracepp; noise = "
             "(max - min) / median over the rounds of tracepp's step or of the ideal priced with each round's costs, "
             "whichever moved more: an error inside it is not the model's",
             "ideal/torch: the ideal over torch's step, the lowest tracepp/torch a runtime with no overhead and free "
             "comms could reach running these stage functions with plain autograd",
             "step error, step ideal/tracepp: medians over the paired steps (after the measured ones), each step "
             "priced with the stage costs its own ranks measured right before and after it",
             f"1-minute load average before each run: {_load_range(report)}",
             f"memory: max over ranks of {report.get('memory_method') or 'n/a'}",
             f"load average (1, 5, 15 min) at start {report.get('loadavg_start')}, end {report.get('loadavg_end')}"]
    tuned = report.get("tuner") or {}
    if tuned.get("status") == "ok":
        pick = tuned["pick"]
        notes.append(f"tuner: picked {pick['schedule']}, {pick['num_stages']} stages, M={pick['num_microbatches']}, "
                     f"split {','.join(pick['split_points'])} (predicted {_ms(pick['step_s'])} ms) in "
                     f"{tuned['tune_s']:.1f}s; measured {_ms(tuned['tuned_step_s'])} ms against the best hand-picked "
                     f"case {tuned['hand_picked']} {_ms(tuned['hand_step_s'])} ms, run alternately: "
                     f"pick / hand-picked = {_fmt(tuned.get('tuned_over_hand'), '.3f')} (target <= 1.05)")
    problems = [f"{e['case']} {s}: {e[s].get('status')}: {e[s].get('error')}"
                for e in report["results"] for s in ("tracepp", "torch", "eager", "ideal")
                if s in e and e[s].get("status") not in ("ok", None)]
    mismatched = [e["case"] for e in report["results"] if e.get("same_losses") is False]
    if mismatched:
        problems.append("tracepp and torch losses differ in: " + ", ".join(mismatched))
    problems += [f"{e['case']} floor: {e['floor'].get('status')}: {e['floor'].get('error')}" for e in report["results"]
                 if (e.get("floor") or {}).get("status") not in ("ok", None)]
    mismatched = [e["case"] for e in report["results"] if e.get("floor_same_losses") is False]
    if mismatched:
        problems.append("tracepp and the floor loop's losses differ in: " + ", ".join(mismatched))
    return "\n".join([text, ""] + notes + _floor_table(report) + (["", "problems:"] + problems if problems else []))


def _floor_table(report: dict) -> list:
    """The floor loop beside tracepp (``--floor``): the same plan and stage functions, run by the thinnest loop."""
    from tabulate import tabulate

    rows = [[e["schedule"], e["microbatches"], _ms(_time(e, "tracepp")), _ms(_time(e, "floor")),
             _fmt(e.get("tracepp_over_floor"), ".3f"), _fmt(e.get("efficiency_stepwise"), ".2f"),
             _fmt(e.get("floor_efficiency_stepwise"), ".2f"),
             {True: "yes", False: "NO"}.get(e.get("floor_same_losses"), "-"), e["model"]["name"]]
            for e in report["results"] if e.get("floor")]
    if not rows:
        return []
    headers = ["schedule", "M", "tracepp ms", "floor ms", "tracepp/floor (rounds)", "step ideal/tracepp",
               "step ideal/floor", "same losses", "model"]
    return ["", "floor: tracepp's plan run by the thinnest loop (benchmarks/floor_worker.py: the same stage functions "
            "with plain autograd, the same action order, tracepp's shared-memory transport, one all-reduce per step, "
            "no checks)",
            tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)]


def _load_range(report: dict) -> str:
    loads = [value for e in report["results"] for s in SYSTEMS for value in (e.get(s) or {}).get("loadavg_1min", [])
             if value is not None]
    return f"{min(loads):.2f} to {max(loads):.2f}" if loads else "n/a"


def write_chart(report: dict, path: str):
    try:
        import matplotlib
    except ImportError:
        print("chart skipped: matplotlib is not installed (pip install -e \".[bench]\")")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["results"]
    labels = [f"{e['model']['name'].split('_b')[0]} R{e['ranks']}\n{e['schedule']} M{e['microbatches']}"
              for e in entries]
    series = [("tracepp / torch (step time; <1: tracepp faster)", "ratio_tracepp_over_torch"),
              ("ideal / tracepp (1: the schedule's best)", "efficiency")]
    if report["device"] == "cuda":
        series = series[1:]
    fig, axes = plt.subplots(len(series), 1, figsize=(max(6, 0.7 * len(entries) + 2), 3.2 * len(series)),
                             squeeze=False)
    for axis, (title, key) in zip(axes[:, 0], series):
        values = [e.get(key) or 0.0 for e in entries]
        axis.bar(range(len(values)), values, color="tab:blue")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(title, fontsize=10)
        axis.set_xticks(range(len(values)))
        axis.set_xticklabels(labels, fontsize=7, rotation=60, ha="right")
    fig.suptitle(f"tracepp benchmarks ({report['device']}, {report['started']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------

REPRODUCIBLE = """what you can reproduce (figures in docs/benchmarks.md, results in benchmarks/results/):
  python -m benchmarks.run --quick            tracepp vs torch.distributed.pipelining, the ideal, the prediction
  python -m benchmarks.run                    the same over GPT d128/256/512, 2 and 4 ranks
  python -m benchmarks.run --device cuda      one GPU: tracepp vs eager, and a 4-GPU prediction
  python -m benchmarks.dp_pp                  DP x PP (FSDP2) against torch's own pieces and torchtitan's recipe
  python -m benchmarks.real_size plan|load    planning a 7B/70B shape without weights; per-rank loading memory
  python -m benchmarks.activation_checkpointing   step time and peak memory per mode
  python -m benchmarks.cuda_path              the unchanged rank scripts on CUDA, against eager
  python -m benchmarks.gpu_stage              a Llama-7B-shaped stage on one GPU: step, memory, MFU
  python -m benchmarks.gpu_predict            the simulator's multi-GPU prediction from one GPU's stage times
one-off studies, each with its question: benchmarks/studies/ (python -m benchmarks.studies.NAME --help)"""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0],
                                     epilog=REPRODUCIBLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small suite (with the stage costs and the tuner), about 6 minutes on 2 CPU cores")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"), help="where the JSON and PNG go")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every process (default 1)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per system per case (quick 2, else 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps dropped per run (quick 2, else 3)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (quick 5, else 10)")
    parser.add_argument("--paired-steps", type=int, default=None,
                        help="CPU: steps after the measured ones, each priced with stage costs its ranks measure "
                             "right before and after it (default 6; 0: none, the ideal from stage_times alone)")
    parser.add_argument("--filter", default=None, help="only cases whose name contains this text")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (model files, outputs, logs)")
    parser.add_argument("--no-tune", action="store_true", help="--quick: skip the tuner's benchmark")
    parser.add_argument("--floor", action="store_true",
                        help="CPU: run each tracepp plan by the thinnest loop as well (benchmarks/floor_worker.py), "
                             "next to tracepp in every round: what the gap to the ideal is without tracepp's runtime")
    parser.add_argument("--tune", action="store_true", help="run the tuner's benchmark (default with --quick)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the CI harness test
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda but CUDA is not available (torch.cuda.is_available() is False, torch "
                  f"{torch.__version__}); run on a GPU machine or use --device cpu", file=sys.stderr)
            return 2
        cases = cuda_cases(args.quick)
    else:
        cases = cpu_cases(args.quick)
    if args.tiny:
        config = GPTConfig(d_model=32, n_layer=2, n_head=2, vocab=64, seq=8, batch=4)
        cases = [Case(config, 2, "1f1b", 2, 2, 2)]
    if args.filter:
        cases = [c for c in cases if args.filter in c.key]
        if not cases:
            print(f"error: no case matches --filter {args.filter!r}", file=sys.stderr)
            return 2
    quick = args.quick or args.tiny
    settings = Settings(rounds=args.rounds or (2 if quick else 3), warmup=args.warmup or (2 if quick else 3),
                        measured=args.steps or (5 if quick else 10), timeout=300.0 if quick else 900.0,
                        paired=args.paired_steps if args.paired_steps is not None else (2 if args.tiny else 6),
                        floor=args.floor or args.tiny)
    if settings.rounds * settings.measured < 10:
        print(f"note: {settings.rounds} rounds x {settings.measured} steps = fewer than 10 measured steps per system")
    started = datetime.datetime.now()
    load_start = loadavg()
    work = tempfile.mkdtemp(prefix="tracepp_bench_")
    print(f"{len(cases)} cases, {settings.rounds} rounds x ({settings.warmup} warm-up + {settings.measured} "
          f"measured + {MEMORY_STEPS} untimed memory) steps per system (tracepp on CPU: + 1 + {settings.paired} "
          f"paired), device {args.device}, work folder {work}", flush=True)
    try:
        suite = run_suite(cases, settings, args.device, args.threads, work,
                          log=lambda text: print(text, flush=True), tune=(args.quick or args.tune) and not args.no_tune)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.device == "cuda":
        _add_predictions(suite["results"])
    import torch

    methods = {e[s].get("memory_method") for e in suite["results"] for s in SYSTEMS
               if s in e and e[s].get("memory_method")}
    report = {"started": started.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device, "quick": args.quick,
              "elapsed_s": suite["elapsed_s"], "settings": vars(settings), "threads_per_process": args.threads,
              "memory_method": "; ".join(sorted(methods)) or None,
              "loadavg_start": load_start, "loadavg_end": loadavg(), "comm": suite.get("comm"),
              "tuner": suite.get("tuner"),
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "platform": platform.platform(), "cpu_count": os.cpu_count(),
                              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None},
              "results": suite["results"]}
    table = format_table(report)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{started.strftime('%Y%m%d-%H%M%S')}_{args.device}{'_quick' if args.quick else ''}")
    with open(stem + ".json", "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {stem}.json")
    chart = write_chart(report, stem + ".png")
    if chart:
        print(f"wrote {chart}")
    print(f"suite took {suite['elapsed_s']:.0f}s")
    return 0


def _add_predictions(results: list) -> None:
    """CUDA: the simulated step time of the same plan on ``ranks`` GPUs, from this GPU's stage times."""
    for entry in results:
        ideal = entry.get("ideal", {})
        entry["prediction"] = {"status": ideal.get("status"), "gpus": entry["ranks"],
                               "step_time_s": ideal.get("predicted_step_s")}


if __name__ == "__main__":
    sys.exit(main())
