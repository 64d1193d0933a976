"""Planning time at real size: each model planned on meta tensors (nothing allocated) by ``tracepp split`` in a
process of its own, timed per step, and ``plan --tune`` searching its space on the biggest folders.

    python -m benchmarks.plan_time [--cases llama7b,dsv3_16,...] [--no-tune] [--out benchmarks/results]
    python -m benchmarks.plan_time --table RESULT.json     # docs/benchmarks.md's table

Every split runs as a user planning for 80 GB GPUs would: ``--precision bf16 --optimizer adamw --device cuda
--activation-checkpointing auto --memory-limit 80GB`` (each stage's checkpointing chosen to fit; a layout that
cannot fit is refused, and the refusal is timed like a plan), but for the folder a tune prices tensor parallelism
on (split at tp 1 without a limit: ``calibrate`` takes tp=1 splits only). Per case: the process's wall time, CPU time and
peak resident set (``os.wait4``), and the driver's steps (``tracepp split --timings``: load, trace, split, cp, tp
and ep plans, schedule, memory, emit). Tune cases run ``plan --tune`` on a folder split before (its calibration
made from the stages' FLOPs at a nominal 400 TFLOP/s: the search, not the prediction, is what is timed) and
record how many plans it priced.

The goal (issue 56): every case within 60 s and 2 GB on a 2-core machine, every tune within 120 s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks import write_result
from benchmarks.memory_plans import _communicate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MEMORY = ["--precision", "bf16", "--optimizer", "adamw", "--device", "cuda",
          "--activation-checkpointing", "auto", "--memory-limit", "80GB"]
LLAMA = "llama_shapes.py"
DSV3 = "deepseek_v3_shape.py"
GOAL_S, GOAL_GB, TUNE_GOAL_S = 60.0, 2.0, 120.0

# name -> (model file, environment, split options, what it is[, run options in place of MEMORY])
CASES = {
    "llama7b": (LLAMA, {"TRACEPP_LLAMA": "7b", "TRACEPP_LLAMA_SEQ": "4096", "TRACEPP_LLAMA_BATCH": "8"},
                ["--ranks", "4", "--schedule", "1f1b", "--microbatches", "8"],
                "Llama 7B, 4,096 tokens, pp 4, 1F1B, 8 microbatches"),
    "llama7b_tp2": (LLAMA, {"TRACEPP_LLAMA": "7b", "TRACEPP_LLAMA_SEQ": "4096", "TRACEPP_LLAMA_BATCH": "8"},
                    ["--ranks", "4", "--schedule", "1f1b", "--microbatches", "8", "--tp", "2",
                     "--sequence-parallel"],
                    "Llama 7B, 4,096 tokens, pp 4 x tp 2 + SP"),
    "llama7b_cp2": (LLAMA, {"TRACEPP_LLAMA": "7b", "TRACEPP_LLAMA_SEQ": "4096", "TRACEPP_LLAMA_BATCH": "8"},
                    ["--ranks", "4", "--schedule", "1f1b", "--microbatches", "8", "--cp", "2"],
                    "Llama 7B, 4,096 tokens, pp 4 x cp 2"),
    "llama70b": (LLAMA, {"TRACEPP_LLAMA": "70b", "TRACEPP_LLAMA_SEQ": "4096", "TRACEPP_LLAMA_BATCH": "128"},
                 ["--ranks", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "8"],
                 "Llama 70B, 4,096 tokens, pp 16 x dp 8 (FSDP)"),
    "llama70b_tp8": (LLAMA, {"TRACEPP_LLAMA": "70b", "TRACEPP_LLAMA_SEQ": "4096", "TRACEPP_LLAMA_BATCH": "32"},
                     ["--ranks", "8", "--schedule", "1f1b", "--microbatches", "16", "--dp", "2", "--tp", "8",
                      "--sequence-parallel"],
                     "Llama 70B, 4,096 tokens, pp 8 x dp 2 x tp 8 + SP"),
    "llama70b_cp2": (LLAMA, {"TRACEPP_LLAMA": "70b", "TRACEPP_LLAMA_SEQ": "4096", "TRACEPP_LLAMA_BATCH": "128"},
                     ["--ranks", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "8", "--cp", "2"],
                     "Llama 70B, 4,096 tokens, pp 16 x dp 8 x cp 2"),
    "llama405b": (LLAMA, {"TRACEPP_LLAMA": "405b", "TRACEPP_LLAMA_SEQ": "8192", "TRACEPP_LLAMA_BATCH": "64"},
                  ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "4"],
                  "Llama 3 405B, 8,192 tokens, pp 16 x dp 4 (FSDP), no tp (its gathered stage alone is over 80 GB: "
                  "refused, naming what would fit)"),
    "llama405b_tp8": (LLAMA, {"TRACEPP_LLAMA": "405b", "TRACEPP_LLAMA_SEQ": "8192", "TRACEPP_LLAMA_BATCH": "64"},
                      ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "4",
                       "--tp", "8", "--sequence-parallel"],
                      "Llama 3 405B, 8,192 tokens, pp 16 x dp 4 x tp 8 + SP"),
    "llama405b_tp8_cp2": (LLAMA, {"TRACEPP_LLAMA": "405b", "TRACEPP_LLAMA_SEQ": "8192", "TRACEPP_LLAMA_BATCH": "64"},
                          ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp",
                           "2", "--tp", "8", "--sequence-parallel", "--cp", "2"],
                          "Llama 3 405B, 8,192 tokens, pp 16 x dp 2 x cp 2 x tp 8 + SP"),
    "llama405b_tunable": (LLAMA, {"TRACEPP_LLAMA": "405b", "TRACEPP_LLAMA_SEQ": "8192", "TRACEPP_LLAMA_BATCH": "64"},
                          ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp",
                           "4"],
                          "Llama 3 405B, pp 16 x dp 4, planned without a memory limit (the folder `plan --tune "
                          "--tp-sizes 1,8` prices: calibrate takes a tp=1 split)",
                          ["--precision", "bf16", "--optimizer", "adamw", "--device", "cuda"]),
    "dsv3_16": (DSV3, {"DEEPSEEK_V3_BATCH": "512"},
                ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "32",
                 "--ep", "32"],
                "DeepSeek-V3 671B, 4,096 tokens, pp 16 x dp 32 x ep 32, 1F1B"),
    "dsv3_32": (DSV3, {"DEEPSEEK_V3_BATCH": "512"},
                ["--ranks", "16", "--stages", "32", "--schedule", "interleaved-1f1b", "--microbatches", "16",
                 "--dp", "32", "--ep", "32"],
                "DeepSeek-V3 671B, 4,096 tokens, 32 stages on pp 16 x dp 32 x ep 32, interleaved 1F1B"),
    "dsv3_16_tp8": (DSV3, {"DEEPSEEK_V3_BATCH": "512"},
                    ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "32",
                     "--ep", "32", "--tp", "8"],
                    "DeepSeek-V3 671B, 4,096 tokens, pp 16 x dp 32 x ep 32 x tp 8"),
    "dsv3_16_cp2": (DSV3, {"DEEPSEEK_V3_BATCH": "512"},
                    ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "32",
                     "--ep", "32", "--cp", "2"],
                    "DeepSeek-V3 671B, 4,096 tokens, pp 16 x dp 32 x cp 2 x ep 32"),
    "kimi1t": (DSV3, {"DEEPSEEK_V3_SHAPE": "kimi_k2", "DEEPSEEK_V3_BATCH": "1024"},
               ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16", "--dp", "64",
                "--ep", "64"],
               "Kimi-K2-shaped 1T MoE, 4,096 tokens, pp 16 x dp 64 x ep 64"),
}

# tune cases: (the split case whose folder is tuned, plan --tune options)
TUNES = {
    "tune_dsv3": ("dsv3_16", ["--memory-limit", "80GB"]),  # its ep sizes need an ep=1 split: refused at --ep 32
    "tune_llama405b": ("llama405b_tunable", ["--tp-sizes", "1,8", "--memory-limit", "80GB"]),
}

NOMINAL_FLOPS = 4e14  # the stage costs of the tune's calibration: FLOPs at 400 TFLOP/s (the search is timed)


def _run(command: list, env_extra: dict, timeout_s: float = 900) -> dict:
    """Run ``command`` with ``env_extra``: wall, CPU and peak RSS of its process, its return code and output;
    killed after ``timeout_s`` (then ``stderr`` says so)."""
    import threading

    env = dict(os.environ, PYTHONPATH=REPO, **env_extra)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(timeout_s, process.kill)
    timer.start()
    stdout, stderr = _communicate(process)
    timer.cancel()
    if time.perf_counter() - start >= timeout_s:
        stderr += f"\nerror: stopped after {timeout_s:.0f} s"
    usage = process.usage
    return {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2), "returncode": process.returncode,
            "stdout": stdout, "stderr": stderr}


def split_case(name: str, root: str) -> dict:
    model, env_extra, options, case, *run = CASES[name]
    out = os.path.join(root, name)
    timings = os.path.join(root, f"{name}_timings.json")
    command = [sys.executable, "-m", "tracepp", "split", os.path.join(HERE, model), "-o", out, *options,
               *(run[0] if run else MEMORY),
               "--timings", timings]
    ran = _run(command, env_extra)
    record = {"case": case, "command": " ".join(command[3:-2]), "environment": env_extra,
              **{k: ran[k] for k in ("wall_s", "cpu_s", "peak_rss_gb", "returncode")}}
    if os.path.isfile(timings):
        with open(timings) as handle:
            record["steps"] = {s["name"]: {"wall_s": s["wall_s"], "cpu_s": s["cpu_s"],
                                           "peak_rss_gb": round(s["peak_rss_bytes"] / 1e9, 2)}
                               for s in json.load(handle)["steps"]}
    if ran["returncode"] != 0:
        lines = [line for line in ran["stderr"].strip().splitlines() if "error" in line.lower()]
        record["error"] = (lines or ran["stderr"].strip().splitlines() or ["?"])[-1][:800]
        return record
    with open(os.path.join(out, "manifest.json")) as handle:
        manifest = json.load(handle)
    ranks = manifest["memory"]["ranks"]
    record.update({"parameters_b": round(sum(s["num_params"] for s in manifest["stages"]) / 1e9, 1),
                   "stages": len(manifest["stages"]), "max_peak_gb": round(max(r["peak_bytes"] for r in ranks) / 1e9, 2),
                   "activation_checkpointing": manifest["run_options"]["activation_checkpointing"]})
    return record


def tune_case(name: str, root: str) -> dict:
    split_name, options = TUNES[name]
    folder = os.path.join(root, split_name)
    _model, env_extra, _options, case, *_rest = CASES[split_name]
    if not os.path.isfile(os.path.join(folder, "manifest.json")):
        return {"case": f"plan --tune on {case}", "error": f"no folder to tune: the {split_name} split was refused "
                                                            f"or not run"}
    with open(os.path.join(folder, "manifest.json")) as handle:
        manifest = json.load(handle)
    costs = {}
    for stage in manifest["stages"]:
        forward = stage["forward_flops"] / NOMINAL_FLOPS
        costs[f"{stage['index']}F"], costs[f"{stage['index']}B"] = forward, 2 * forward
    costs_path = os.path.join(root, f"{name}_costs.json")
    with open(costs_path, "w") as handle:
        json.dump(costs, handle)
    calibrate = _run([sys.executable, "-m", "tracepp", "calibrate", folder, "--costs", costs_path, "--no-comm",
                      "--no-fit"], env_extra)
    if calibrate["returncode"] != 0:
        return {"case": f"plan --tune on {case}", "error": calibrate["stderr"].strip()[-800:]}
    command = [sys.executable, "-m", "tracepp", "plan", folder, "--tune", *options]
    ran = _run(command, env_extra)
    record = {"case": f"plan --tune on {case}", "command": " ".join(command[3:]), "environment": env_extra,
              **{k: ran[k] for k in ("wall_s", "cpu_s", "peak_rss_gb", "returncode")}}
    priced = re.search(r"(\d+) candidates: (\d+) plans priced(?: \((\d+) within)?", ran["stdout"])
    record["candidates"] = int(priced.group(1)) if priced else None  # priced, and those the planner refused
    record["plans_priced"] = int(priced.group(2)) if priced else None
    record["plans_kept"] = int(priced.group(3) or priced.group(2)) if priced else None
    figures = re.search(r"computed in ([\d.]+) s", ran["stdout"])
    record["figures_s"] = float(figures.group(1)) if figures else 0.0
    if ran["returncode"] != 0:
        record["error"] = (ran["stderr"].strip().splitlines() or ["?"])[-1][:800]
    return record


def table(result: dict) -> str:
    """docs/benchmarks.md's table from a result file."""
    steps = ["trace", "split", "cp plan", "tp plan", "ep plan", "memory", "emit"]
    lines = ["| case | wall s | CPU s | peak GB | " + " | ".join(steps) + " | goal |",
             "| --- " * (len(steps) + 5) + "|"]
    for name, row in result["cases"].items():
        by_step = row.get("steps") or {}
        cells = [f"{by_step[s]['wall_s']:.1f}" if s in by_step else "-" for s in steps]
        within = row["wall_s"] <= GOAL_S and row["peak_rss_gb"] <= GOAL_GB
        what = row["case"] + (f" (refused: {row['error'][:120]})" if "error" in row else "")
        lines.append(f"| {what} | {row['wall_s']} | {row['cpu_s']} | {row['peak_rss_gb']} | " + " | ".join(cells)
                     + f" | {_verdict(row, within)} |")
    for name, row in (result.get("tunes") or {}).items():
        within = row.get("wall_s", 1e9) <= TUNE_GOAL_S
        lines.append(f"| {row['case']}: {row.get('plans_priced')} plans priced (figures {row.get('figures_s')} s) | "
                     f"{row.get('wall_s')} | {row.get('cpu_s')} | {row.get('peak_rss_gb')} | "
                     + " | ".join("-" for _ in steps) + f" | {_verdict(row, within)} |")
    return "\n".join(lines)


def _verdict(row: dict, within: bool) -> str:
    """met / NOT met; a plan tracepp refuses with its own message (a layout that cannot fit) is an answer, timed
    like a plan: refused within the goal, or not; anything else that failed: failed."""
    if row.get("returncode") == 0:
        return "met" if within else "NOT met"
    if re.match(r"tracepp \w+: error:", row.get("error", "")):
        return "refused within the goal" if within else "refused, NOT within the goal"
    return "failed"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--tunes", default=",".join(TUNES), help=f"comma-separated, of {', '.join(TUNES)}")
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--table", metavar="RESULT", help="print docs/benchmarks.md's table from a result file")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as handle:
            print(table(json.load(handle)))
        return 0
    names = [n for n in args.cases.split(",") if n]
    tunes = [] if args.no_tune else [t for t in args.tunes.split(",") if t]
    for tune in tunes:  # the folder a tune needs is split first
        if TUNES[tune][0] not in names:
            names.append(TUNES[tune][0])
    result = {"goal": {"split_s": GOAL_S, "split_gb": GOAL_GB, "tune_s": TUNE_GOAL_S}, "cases": {}, "tunes": {}}
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            record = split_case(name, root)
            result["cases"][name] = record
            print(f"{name}: {record['wall_s']} s wall, {record['cpu_s']} s CPU, {record['peak_rss_gb']} GB"
                  + (f"; {record['error']}" if "error" in record else ""), flush=True)
        for name in tunes:
            record = tune_case(name, root)
            result["tunes"][name] = record
            print(f"{name}: {record.get('wall_s')} s wall, {record.get('plans_priced')} plans priced"
                  + (f"; {record['error']}" if "error" in record else ""), flush=True)
    write_result(args.out, "plan_time", result)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
