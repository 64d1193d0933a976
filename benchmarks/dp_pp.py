"""Data parallel x pipeline parallel: tracepp's ``--dp`` against the same job built by hand from torch's pieces.

    python -m benchmarks.dp_pp [--rounds 3] [--steps 10] [--systems tracepp,torch] [--dp-mode fsdp|ddp]
                               [--precision fp32|bf16] [--filter TEXT] [--out benchmarks/results]

Run from the repository root. Every case is 2 pipeline ranks x 2 data-parallel replicas (4 processes, gloo,
CPU) training the same GPT model file (``benchmarks/gpt_model.py``, split at the same block FQN) with the
same schedule, microbatches per replica, mean cross-entropy and SGD, each replica on its contiguous half of the
global batch. The systems:

* ``tracepp``: ``split_model(..., layout=Layout(pp=2, dp=2, dp_mode=MODE))``, then ``torchrun`` on the generated
  ``run.py`` through ``benchmarks/tracepp_worker.py``; its own ``--metrics`` step time (on the last stage's
  rank of replica 0), with run.py's defaults (which include the per-step global gradient-norm check of
  ``--on-nonfinite stop``: one all-reduce of two numbers over the whole mesh);
* ``tracepp-nocheck``: the same with ``--on-nonfinite continue`` (no norm check: what torch's loop does);
* ``torch``: ``benchmarks/torch_dp_worker.py``: ``init_device_mesh`` (dp, pp), ``pipeline`` +
  ``SplitPoint.BEGINNING``, each stage module one ``fully_shard`` unit over dp (``reshard_after_forward=False``,
  as tracepp), ``build_stage`` on the pp group, ``ScheduleGPipe``/``Schedule1F1B``; timed the same way;
* ``torch-blocks``: the same with torchtitan's FSDP units (one per block, the embeddings, ``ln_f`` + head,
  and the stage as root); FSDP only;
* ``torch-manual``: stages built by hand as eager modules, as torchtitan does (``--split manual`` of
  torch_dp_worker.py: no fx interpreter), ``PipelineStage``, one FSDP unit per stage;
* ``torchtitan``: torchtitan's recipe whole: hand-built stages and its per-block FSDP units; FSDP only.

``--precision bf16``: tracepp splits with ``--precision bf16`` (its default ``--mixed-precision params``) and torch's
systems wrap every FSDP unit with the same ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and compute
the loss on fp32-cast outputs (``torch_dp_worker.py --precision bf16``): the same recipe, so the trained parameters
and the all-gather bytes are compared like for like (``comm_bytes_per_rank``: the bytes of each c10d op over plain
tensors in the measured step, an all-gather's gathered buffer, a reduce-scatter's unreduced input).

Runs alternate (the systems' order rotates every round), each run drops its warm-up steps, and the step time
is the median of every measured step of every round; the range is the spread of the per-round medians.
Peak memory per rank: ``benchmarks/memory.py`` (CPU: peak live bytes of torch's CPU allocator during one
untimed step after the timed ones, relative to those live at its start), the same measure for every system.
The same profile counts the ``c10d::`` ops (collectives, sends, receives) every rank issues in that step
(``comm_ops_per_rank`` in the JSON). Round 0 of every case also saves the trained parameters (after the timed steps, untimed) and the report gives
the max difference from tracepp's, and whether the per-step losses agree. Every process runs with
``--threads`` intra-op threads (default 1); every collective and P2P op has a timeout (``--timeout``), and
every run a wall-clock limit (``--run-timeout``) after which its whole process tree is stopped.

Each process also reads its own CPU time (``time.process_time``, every thread) over the timed steps; the table
gives its sum over the 4 processes per step: on a machine shared with other jobs, wall time measures the
machine's load as much as the systems, CPU time mostly the work each system does.

Results: a table on stdout, ``OUT/<date>_cpu_dp_pp.json`` and, with matplotlib, ``OUT/<date>_cpu_dp_pp.png``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.gpt_model import GPTConfig, write_model_file
from benchmarks.memory import MEMORY_STEPS, read_memory
from benchmarks.predict import loadavg
from benchmarks.run import Settings, _env, _fmt, _launcher_hiccup, _merge, _ms, _read_steps, _run, _torchrun

SYSTEMS = ("tracepp", "tracepp-nocheck", "torch", "torch-blocks", "torch-manual", "torchtitan")
TORCH_LAYOUT = {"torch": ("tracer", "stage"), "torch-blocks": ("tracer", "block"),  # (--split, --fsdp-units)
                "torch-manual": ("manual", "stage"), "torchtitan": ("manual", "block")}
DEFAULT_SYSTEMS = ("tracepp", "torch")
# --precision bf16: torch's tracer frontend (pipeline() + build_stage) keeps the traced fp32 boundary dtypes and
# receives a bf16 activation into an fp32 buffer (its losses are NaN): the hand-built stages are the baseline
BF16_SYSTEMS = ("tracepp", "torch-manual")
TRACER_SYSTEMS = ("torch", "torch-blocks")


def baseline(systems) -> str:
    """The system the others are timed against: torch's tracer frontend, else the first of torch's others."""
    return "torch" if "torch" in systems else next((s for s in systems if not s.startswith("tracepp")), "torch")
PP, DP = 2, 2


@dataclass(frozen=True)
class Case:
    config: GPTConfig
    schedule: str
    microbatches: int  # per replica
    pp: int = PP
    dp: int = DP
    mode: str = "fsdp"
    precision: str = "fp32"

    @property
    def key(self) -> str:
        suffix = "" if self.precision == "fp32" else f"_{self.precision}"
        return f"{self.config.name}_pp{self.pp}_dp{self.dp}_{self.mode}_{self.schedule}_m{self.microbatches}{suffix}"

    @property
    def processes(self) -> int:
        return self.pp * self.dp


def default_cases(mode: str, precision: str = "fp32") -> list:
    config = GPTConfig(d_model=256, n_layer=8, n_head=4, batch=32, seq=32)
    return [Case(config, schedule, microbatches, mode=mode, precision=precision)
            for schedule in ("gpipe", "1f1b") for microbatches in (4, 8)]


def tiny_cases(mode: str, precision: str = "fp32") -> list:
    return [Case(GPTConfig(d_model=32, n_layer=2, n_head=2, vocab=64, seq=8, batch=8), "1f1b", 2, mode=mode,
                 precision=precision)]


# ----------------------------------------------------------------------------------------------------

def _command(system: str, case: Case, model_path: str, out_dir: str, steps: int, metrics: str, memory_dir: str,
             timeout: float, save, warmup: int) -> list:
    if system.startswith("tracepp"):
        cmd = _torchrun(case.processes) + ["-m", "benchmarks.tracepp_worker", out_dir, "--memory-dir", memory_dir,
                                           "--cpu-from-step", str(warmup), "--", "--steps", str(steps), "--metrics", metrics, "--quiet",
                                           "--timeout", str(timeout)]
        if system == "tracepp-nocheck":
            cmd += ["--on-nonfinite", "continue"]
    else:
        cmd = _torchrun(case.processes) + ["-m", "benchmarks.torch_dp_worker", "--model-file", model_path,
                                           "--dp", str(case.dp), "--dp-mode", case.mode,
                                           "--schedule", case.schedule, "--microbatches", str(case.microbatches),
                                           "--steps", str(steps), "--metrics", metrics, "--memory-dir", memory_dir,
                                           "--timeout", str(timeout), "--cpu-from-step", str(warmup),
                                           "--split", TORCH_LAYOUT[system][0], "--fsdp-units", TORCH_LAYOUT[system][1],
                                           "--precision", case.precision]
    if save:
        cmd += ["--save", save]
    return cmd


def run_system(system: str, case: Case, model_path: str, out_dir: str, work: str, round_index: int,
               settings: Settings, threads: int, peer_timeout: float, save: bool) -> dict:
    tag = f"{system}_{case.key}_round{round_index}"
    metrics = os.path.join(work, tag + ".jsonl")
    memory_dir = os.path.join(work, tag + "_mem")
    log = os.path.join(work, tag + ".log")
    save_path = os.path.join(work, tag + "_params.pt") if save else None
    steps = settings.warmup + settings.measured + MEMORY_STEPS  # the last ones: memory window, never timed
    cmd = _command(system, case, model_path, out_dir, steps, metrics, memory_dir, peer_timeout, save_path,
                   settings.warmup)
    load_before = _loadavg()
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
              "loadavg_before": load_before, "loadavg_after": _loadavg(),
              "step_times": [line["step_time_s"] for line in lines[settings.warmup:settings.warmup + settings.measured]],
              "losses": [line["loss"] for line in lines], "memory": read_memory(memory_dir),
              "params": save_path if ok and save_path and os.path.exists(save_path) else None}
    if ok and len(lines) != steps:
        result["error"] = f"wrote {len(lines)} metric lines, expected {steps}"
    return result


def _summary(runs: list, tokens: int) -> dict:
    merged = _merge(runs, tokens)
    if merged["status"] != "ok":
        return merged
    medians = [statistics.median(r["step_times"]) for r in runs if r["ok"] and r["step_times"]]
    merged["round_medians_s"] = medians
    merged["range_s"] = [min(medians), max(medians)]
    merged["mean_peak_mem_mb"] = statistics.mean(merged["peak_mem_mb_per_rank"]) if merged["peak_mem_mb_per_rank"] else None
    # CPU time per step (all threads of a process) over the timed steps: per rank (median over the rounds), and
    # the sum over the ranks (median and range over the rounds)
    cpu_runs = [[m.get("cpu_s_per_step") for m in r["memory"]] for r in runs if r["ok"]]
    cpu_runs = [c for c in cpu_runs if c and all(v is not None for v in c)]
    if cpu_runs:
        merged["cpu_s_per_step_per_rank"] = [statistics.median(c[k] for c in cpu_runs) for k in range(len(cpu_runs[0]))]
        sums = [sum(c) for c in cpu_runs]
        merged["cpu_s_per_step"] = statistics.median(sums)
        merged["cpu_s_per_step_range"] = [min(sums), max(sums)]
    # the c10d ops each rank issued in its measured memory step (same profile as the memory; a count per op)
    first = next(r for r in runs if r["ok"])
    merged["comm_ops_per_rank"] = [m.get("comm_ops") for m in first["memory"]]
    merged["comm_bytes_per_rank"] = [m.get("comm_bytes") for m in first["memory"]]
    return merged


def _param_diff(path_a, path_b):
    import torch

    if not path_a or not path_b:
        return None
    a, b = torch.load(path_a), torch.load(path_b)
    if sorted(a) != sorted(b):
        return {"error": f"parameter names differ: {sorted(set(a) ^ set(b))[:6]}"}
    diffs = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a}
    worst = max(diffs, key=diffs.get)
    return {"max_abs_diff": diffs[worst], "worst_param": worst, "params": len(a)}


def _same_losses(a: list, b: list) -> bool:
    return bool(a and b and len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b)))


def run_suite(cases: list, systems: list, settings: Settings, threads: int, peer_timeout: float, work: str,
              log=print) -> dict:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    started = time.perf_counter()
    results = []
    for number, case in enumerate(cases, 1):
        config = case.config
        tokens = config.tokens_per_step
        case_dir = os.path.join(work, case.key)
        model_path = write_model_file(os.path.join(case_dir, "model.py"), config, case.pp)
        out_dir = os.path.join(case_dir, "tracepp_out")
        entry = {"case": case.key, "model": config.to_json(), "pp": case.pp, "dp": case.dp, "dp_mode": case.mode,
                 "processes": case.processes, "schedule": case.schedule, "microbatches_per_replica": case.microbatches,
                 "precision": case.precision,
                 "microbatch_size": config.batch // case.dp // case.microbatches, "global_batch": config.batch,
                 "tokens_per_step": tokens, "split_points": config.split_points(case.pp)}
        log(f"[{number}/{len(cases)}] {case.key} ({time.perf_counter() - started:.0f}s)")
        try:
            split_model(model_path, out_dir, schedule=case.schedule,
                        num_microbatches=case.microbatches, split_points=config.split_points(case.pp),
                        layout=Layout(pp=case.pp, dp=case.dp, dp_mode=case.mode),
                        run=RunOptions(precision=case.precision))
            split_error = None
        except Exception as error:  # reported, not fatal
            split_error = f"{type(error).__name__}: {error}"
        runs = {s: [] for s in systems}
        for round_index in range(settings.rounds):
            shift = round_index % len(systems)
            for system in systems[shift:] + systems[:shift]:
                if system.startswith("tracepp") and split_error:
                    continue
                result = run_system(system, case, model_path, out_dir, case_dir, round_index, settings, threads,
                                    peer_timeout, save=round_index == 0)
                status = "ok" if result["ok"] else f"FAILED: {result['error']}"
                median = statistics.median(result["step_times"]) if result["step_times"] else None
                log(f"    round {round_index} {system}: {status} median {_ms(median)} ms ({result['wall_s']:.0f}s)")
                runs[system].append(result)
        for system in systems:
            entry[system] = ({"status": "unsupported", "error": split_error}
                             if system.startswith("tracepp") and split_error else _summary(runs[system], tokens))
        reference = "tracepp" if "tracepp" in systems else systems[0]
        first = {s: (runs[s][0] if runs[s] else None) for s in systems}
        entry["validation"] = {}
        for system in systems:
            if system == reference or not first[system] or not first[reference]:
                continue
            entry["validation"][system] = dict(
                _param_diff(first[reference]["params"], first[system]["params"]) or {"error": "no saved parameters"},
                same_losses=_same_losses(first[reference]["losses"], first[system]["losses"]), against=reference)
        _derive(entry, systems)
        entry["loadavg_1min_seen"] = sorted(float(r[key].split()[0]) for s in systems for r in runs[s]
                                            for key in ("loadavg_before", "loadavg_after") if r[key] != "n/a")
        results.append(entry)
    return {"results": results, "elapsed_s": time.perf_counter() - started}


def _time(entry: dict, system: str):
    part = entry.get(system) or {}
    return part.get("step_time_s") if part.get("status") == "ok" else None


def _derive(entry: dict, systems: list) -> None:
    entry["ratios_over_torch"] = {}
    base = baseline(systems)
    entry["baseline"] = base
    torch_time = _time(entry, base)
    for system in systems:
        mine = _time(entry, system)
        if system != base and mine and torch_time:
            entry["ratios_over_torch"][system] = mine / torch_time
    entry["ratio_tracepp_over_torch"] = entry["ratios_over_torch"].get("tracepp")


# ----------------------------------------------------------------------------------------------------

def _cpu_ratio(entry: dict, system: str):
    mine, base = ((entry.get(s) or {}).get("cpu_s_per_step") for s in (system, entry.get("baseline", "torch")))
    return mine / base if mine and base else None


def _mem(part: dict) -> str:
    values = part.get("peak_mem_mb_per_rank") or []
    return " / ".join(f"{v:.1f}" for v in values) if values else "-"


def format_table(report: dict) -> str:
    from tabulate import tabulate

    systems = report["systems"]
    rows = []
    for e in report["results"]:
        for system in systems:
            part = e.get(system) or {}
            rng = part.get("range_s")
            base = e.get("baseline", "torch")
            ratio = e["ratios_over_torch"].get(system) if system != base else (1.0 if _time(e, base) else None)
            check = e["validation"].get(system)
            check_text = ("reference" if system == "tracepp" else
                          f"{check.get('max_abs_diff', float('nan')):.1e}{'' if check.get('same_losses') else ' LOSSES DIFFER'}"
                          if check and "max_abs_diff" in check else (check or {}).get("error", "-"))
            rows.append([e["model"]["name"], e["schedule"], e["microbatches_per_replica"], system,
                         _ms(_time(e, system)), f"{_ms(rng[0])} - {_ms(rng[1])}" if rng else "-",
                         _fmt(part.get("tokens_per_s"), ",.0f"), _fmt(ratio, ".2f"),
                         _ms(part.get("cpu_s_per_step")), _fmt(_cpu_ratio(e, system), ".2f"), _mem(part), check_text])
    base = baseline(systems)
    headers = ["model", "schedule", "M/replica", "system", "step ms", "round medians ms", "tokens/s", f"vs {base}",
               "CPU ms/step (4 ranks)", f"CPU vs {base}", "peak MB rank 0/1/2/3", "max |param diff|"]
    text = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
    notes = [f"pp {PP} x dp {DP} ({report['dp_mode']}, precision {report.get('precision', 'fp32')}), 4 processes, "
             f"gloo, {report['threads_per_process']} intra-op "
             f"thread(s) each; {report['environment']['cpu_count']} CPU cores; load average "
             f"{report['loadavg_start']} at the start, {report['loadavg_end']} at the end, 1-minute load "
             f"{_load_span(report)} before/after the runs",
             "step time: median of all measured steps over alternating rounds (warm-up dropped), on the last stage's "
             "rank of replica 0; round medians: the spread of the per-round medians",
             f"memory: {report.get('memory_method') or 'n/a'}; ranks 0/1: replica 0's pipeline ranks 0/1, 2/3: replica 1's",
             "CPU ms/step: CPU time (every thread) per timed step summed over the 4 processes, median over rounds: "
             "the work done, less sensitive than wall time to other jobs on the machine",
             "max |param diff|: trained parameters after round 0 against tracepp's (same seed and batches)"]
    comms = []
    for e in report["results"]:
        for system in systems:
            ops = (e.get(system) or {}).get("comm_ops_per_rank")
            if ops:
                text_ops = " | ".join(", ".join(f"{k.replace('c10d::', '')} {v}" for k, v in (rank_ops or {}).items())
                                      for rank_ops in ops)
                comms.append(f"  {e['schedule']} M{e['microbatches_per_replica']} {system}: {text_ops}")
    if comms:
        notes += ["c10d ops issued per step, ranks 0 | 1 | 2 | 3 (one measured step):"] + comms
    moved = []
    for e in report["results"]:
        for system in systems:
            found = (e.get(system) or {}).get("comm_bytes_per_rank")
            if found:
                text_bytes = " | ".join(", ".join(f"{k.replace('c10d::', '')} {v:,}" for k, v in (rank or {}).items())
                                        for rank in found)
                moved.append(f"  {e['schedule']} M{e['microbatches_per_replica']} {system}: {text_bytes}")
    if moved:
        notes += ["bytes of the c10d ops over plain tensors per step (all-gather: gathered buffer; reduce-scatter: "
                  "unreduced input), ranks 0 | 1 | 2 | 3:"] + moved
    problems = [f"{e['case']} {s}: {e[s].get('status')}: {e[s].get('error')}"
                for e in report["results"] for s in systems if e.get(s, {}).get("status") not in ("ok", None)]
    return "\n".join([text, ""] + notes + (["", "problems:"] + problems if problems else []))


def _load_span(report: dict) -> str:
    seen = [v for e in report["results"] for v in e.get("loadavg_1min_seen", [])]
    return f"{min(seen):.1f} - {max(seen):.1f} (median {statistics.median(seen):.1f})" if seen else "n/a"


def write_chart(report: dict, path: str):
    try:
        import matplotlib
    except ImportError:
        print("chart skipped: matplotlib is not installed (pip install -e \".[bench]\")")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries, systems = report["results"], report["systems"]
    labels = [f"{e['schedule']} M{e['microbatches_per_replica']}" for e in entries]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(max(12, 3.3 * len(entries) + 4), 3.8))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(entries))]
        times = [(_time(e, system) or 0) * 1000 for e in entries]
        low = [t - (e.get(system, {}).get("range_s") or [0, 0])[0] * 1000 if t else 0 for t, e in zip(times, entries)]
        high = [(e.get(system, {}).get("range_s") or [0, 0])[1] * 1000 - t if t else 0 for t, e in zip(times, entries)]
        left.bar(xs, times, width, yerr=[[max(0, v) for v in low], [max(0, v) for v in high]], label=system, capsize=2)
        cpus = [(e.get(system, {}).get("cpu_s_per_step") or 0) * 1000 for e in entries]
        spans = [e.get(system, {}).get("cpu_s_per_step_range") or [0, 0] for e in entries]
        middle.bar(xs, cpus, width, label=system, capsize=2,
                   yerr=[[max(0, c - r[0] * 1000) if c else 0 for c, r in zip(cpus, spans)],
                         [max(0, r[1] * 1000 - c) if c else 0 for c, r in zip(cpus, spans)]])
        mems = [e.get(system, {}).get("peak_mem_mb") or 0 for e in entries]
        right.bar(xs, mems, width, label=system)
    for axis, title in ((left, "wall step time (ms; median, bars: round medians)"),
                        (middle, "CPU time per step, 4 processes (ms; bars: rounds)"),
                        (right, "peak memory, max over ranks (MB)")):
        axis.set_title(title, fontsize=9)
        axis.set_xticks(range(len(entries)))
        axis.set_xticklabels(labels, fontsize=8)
        axis.legend(fontsize=7)
    model = entries[0]["model"]["name"] if entries else ""
    fig.suptitle(f"DP x PP: pp {PP} x dp {DP} {report['dp_mode']}, {model}, CPU gloo ({report['started']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------

def _loadavg() -> str:
    """The 1, 5 and 15-minute load averages as one string (the JSON's format), or "n/a"."""
    return " ".join(map(str, loadavg())) or "n/a"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dp_pp", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"), help="where the JSON and PNG go")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, from {', '.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)}; "
                             f"with --precision bf16 {','.join(BF16_SYSTEMS)})")
    parser.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "ddp"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: tracepp's --precision bf16 against torch's FSDP with the same MixedPrecisionPolicy")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every process (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per system per case (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps dropped per run (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run (default 10)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for every collective/P2P op")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="wall-clock limit of one run (s)")
    parser.add_argument("--filter", default=None, help="only cases whose name contains this text")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (model files, outputs, logs)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the CI smoke test
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = args.systems or ",".join(BF16_SYSTEMS if args.precision == "bf16" else DEFAULT_SYSTEMS)
    systems = [s.strip() for s in chosen.split(",") if s.strip()]
    if args.precision == "bf16" and set(TRACER_SYSTEMS) & set(systems):
        print(f"error: {', '.join(sorted(set(TRACER_SYSTEMS) & set(systems)))} (torch's pipeline() frontend) keep the "
              f"traced fp32 boundary dtypes and receive bf16 activations into fp32 buffers: with --precision bf16 use "
              f"torch-manual or torchtitan", file=sys.stderr)
        return 2
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(f"error: --systems {chosen!r}: pick from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if args.dp_mode == "ddp" and {"torch-blocks", "torchtitan"} & set(systems):
        print("error: torch-blocks and torchtitan use FSDP's per-block units; drop them with --dp-mode ddp",
              file=sys.stderr)
        return 2
    cases = tiny_cases(args.dp_mode, args.precision) if args.tiny else default_cases(args.dp_mode, args.precision)
    if args.filter:
        cases = [c for c in cases if args.filter in c.key]
        if not cases:
            print(f"error: no case matches --filter {args.filter!r}", file=sys.stderr)
            return 2
    settings = Settings(rounds=args.rounds, warmup=args.warmup, measured=args.steps, timeout=args.run_timeout)
    started = datetime.datetime.now()
    loadavg_start = _loadavg()
    work = tempfile.mkdtemp(prefix="tracepp_dp_pp_")
    print(f"{len(cases)} cases x {len(systems)} systems ({', '.join(systems)}), {settings.rounds} rounds x "
          f"({settings.warmup} warm-up + {settings.measured} measured + {MEMORY_STEPS} untimed memory) steps, "
          f"load average {loadavg_start}, work folder {work}", flush=True)
    try:
        suite = run_suite(cases, systems, settings, args.threads, args.timeout, work,
                          log=lambda text: print(text, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    import torch

    methods = {e[s].get("memory_method") for e in suite["results"] for s in systems
               if s in e and e[s].get("memory_method")}
    report = {"started": started.strftime("%Y-%m-%d %H:%M:%S"), "device": "cpu", "systems": systems,
              "dp_mode": args.dp_mode, "precision": args.precision, "pp": PP, "dp": DP, "elapsed_s": suite["elapsed_s"],
              "settings": vars(settings), "threads_per_process": args.threads,
              "loadavg_start": loadavg_start, "loadavg_end": _loadavg(),
              "memory_method": "; ".join(sorted(methods)) or None,
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "platform": platform.platform(), "cpu_count": os.cpu_count()},
              "results": suite["results"]}
    table = format_table(report)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{started.strftime('%Y%m%d-%H%M%S')}_cpu_dp_pp{'_ddp' if args.dp_mode == 'ddp' else ''}"
                                  f"{'_' + args.precision if args.precision != 'fp32' else ''}")
    with open(stem + ".json", "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {stem}.json")
    chart = write_chart(report, stem + ".png")
    if chart:
        print(f"wrote {chart}")
    print(f"suite took {suite['elapsed_s']:.0f}s")
    failed = [e["case"] for e in report["results"] for s in systems if e.get(s, {}).get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
