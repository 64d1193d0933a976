"""Measure what ``--activation-checkpointing`` saves and costs: peak memory and step time per mode.

    python -m benchmarks.activation_checkpointing [--d-model 256] [--ranks 2] [--microbatches 8] [--rounds 2]
                                                  [--schedules 1f1b,gpipe]

Splits the benchmark GPT (``benchmarks/gpt_model.py``: d_model 256, 8 blocks, batch 32 x 32 tokens) into one
stage per rank with each schedule (1F1B keeps at most R microbatches' activations per stage, GPipe all of
them), then trains it under torchrun once per mode (``none``, ``full``, ``selective``),
the modes alternating over ``--rounds`` rounds. Step time: the median of the runtime's own ``--metrics``
``step_time_s`` on the last stage's rank over the measured steps (warm-up and memory steps dropped). Peak
memory: ``benchmarks/memory.py``'s per-rank measurement (on CPU the peak of live bytes in torch's allocator
during one untimed step, relative to the step's start). Prints a table and writes
``benchmarks/results/<date>_activation_checkpointing_<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.gpt_model import GPTConfig, write_model_file
from benchmarks.memory import MEMORY_STEPS, read_memory
from benchmarks.run import _env, _run, _torchrun

MODES = ("none", "full", "selective")


def run_mode(out_dir: str, work: str, mode: str, round_index: int, ranks: int, steps: int, threads: int) -> dict:
    tag = f"{mode}_round{round_index}"
    metrics = os.path.join(work, tag + ".jsonl")
    memory_dir = os.path.join(work, tag + "_mem")
    command = _torchrun(ranks) + ["-m", "benchmarks.tracepp_worker", out_dir, "--memory-dir", memory_dir, "--",
                                  "--steps", str(steps), "--metrics", metrics, "--quiet",
                                  "--activation-checkpointing", mode]
    ok, error, _wall = _run(command, os.path.join(work, tag + ".log"), _env(threads), 600)
    if not ok:
        raise SystemExit(f"{mode}: {error}")
    with open(metrics) as handle:
        lines = [json.loads(line) for line in handle if line.strip()]
    return {"step_times": [line["step_time_s"] for line in lines], "losses": [line["loss"] for line in lines],
            "memory": read_memory(memory_dir)}


def measure(out_dir: str, work: str, args) -> dict:
    """Per mode: median step time, per-rank peak memory (the lowest over the rounds), final loss."""
    os.makedirs(work, exist_ok=True)
    steps = args.warmup + args.measured + MEMORY_STEPS
    runs = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_mode(out_dir, work, mode, round_index, args.ranks, steps, args.threads))
    results = {}
    for mode in MODES:
        times = [t for run in runs[mode] for t in run["step_times"][args.warmup:args.warmup + args.measured]]
        peaks = {}
        for run in runs[mode]:
            for record in run["memory"]:
                peaks.setdefault(record["rank"], []).append(record["peak_mb"])
        results[mode] = {"median_step_s": statistics.median(times),
                         "peak_mb_per_rank": {rank: min(values) for rank, values in sorted(peaks.items())},
                         "final_loss": runs[mode][0]["losses"][-1]}
    return results


def table(results: dict) -> str:
    base = results["none"]
    rows = []
    for mode, result in results.items():
        peak = result["peak_mb_per_rank"]
        rows.append((mode, f"{result['median_step_s'] * 1000:.1f}",
                     f"{result['median_step_s'] / base['median_step_s']:.2f}",
                     " / ".join(f"{peak[r]:.1f}" for r in peak),
                     " / ".join(f"{peak[r] - base['peak_mb_per_rank'][r]:+.1f}" for r in peak),
                     f"{result['final_loss']:.6f}"))
    header = ("mode", "step ms (median)", "time vs none", "peak MB per rank", "peak vs none (MB)", "final loss")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--measured", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--schedules", default="1f1b,gpipe")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    config = GPTConfig(d_model=args.d_model, n_layer=args.layers)
    work = tempfile.mkdtemp(prefix="tracepp_ac_")
    model_path = write_model_file(os.path.join(work, f"gpt_{config.name}.py"), config, args.ranks)
    all_results = {}
    for schedule in args.schedules.split(","):
        out_dir = os.path.join(work, f"out_{schedule}")
        split_model(model_path, out_dir, schedule=schedule, num_microbatches=args.microbatches, layout=Layout(pp=args.ranks))
        all_results[schedule] = measure(out_dir, os.path.join(work, schedule), args)
        print(f"schedule {schedule}, {args.ranks} ranks, {args.microbatches} microbatches:")
        print(table(all_results[schedule]))
    import torch

    record = {"config": config.to_json(), "ranks": args.ranks, "microbatches": args.microbatches,
              "rounds": args.rounds, "measured_steps": args.measured, "threads": args.threads,
              "device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "results": all_results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{time.strftime('%Y-%m-%d_%H%M')}_activation_checkpointing_{record['device']}.json")
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
