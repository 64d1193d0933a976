"""Plans at scale that fit: each model planned on meta tensors for a cluster of 80 GB GPUs, bf16, AdamW, every
stage's activation checkpointing chosen by ``tracepp split --activation-checkpointing auto --memory-limit 80GB``,
and every rank's predicted peak (counted as issue 46 counts it: what autograd keeps, on fake tensors, over each
rank's timeline, with FSDP's gathered copy, the expert state, the receive buffers and the optimizer's step).

    python -m benchmarks.memory_plans [--cases deepseek_v3,llama3_405b,kimi_k2] [--out benchmarks/results]

Each case runs ``tracepp split`` in a process of its own and records its wall time, CPU time and peak RSS
(``os.wait4``), the chosen checkpointing and each pipeline rank's peak with its parts, beside the layout the
model's peers published for it (``PEERS``, with the source). The goal: planned in under 120 s and 4 GB, every rank
at most 80 GB (the limit is decimal GB; ``--memory-limit`` takes 80GB).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from itertools import groupby

from benchmarks import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LIMIT = "80GB"

# name -> (model file, environment, split options, what it is)
CASES = {
    "deepseek_v3": ("deepseek_v3_shape.py", {"DEEPSEEK_V3_BATCH": "512"},
                    ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16",
                     "--dp", "32", "--ep", "32"],
                    "DeepSeek-V3 671B, 4,096 tokens a sample, 512 ranks: pp 16 x dp 32 (FSDP), experts over ep 32 "
                    "(8 of 256 per rank), 1F1B, 16 microbatches of 1 sample per replica (global batch 512)"),
    "llama3_405b": ("llama_shapes.py", {"TRACEPP_LLAMA": "405b", "TRACEPP_LLAMA_SEQ": "8192",
                                        "TRACEPP_LLAMA_BATCH": "64"},
                    ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16",
                     "--dp", "4", "--tp", "8", "--sequence-parallel"],
                    "Llama 3 405B, 8,192 tokens a sample, 512 ranks: tp 8 with sequence parallelism x pp 16 x dp 4 "
                    "(FSDP), 1F1B, 16 microbatches of 1 sample per replica (global batch 64)"),
    "kimi_k2": ("deepseek_v3_shape.py", {"DEEPSEEK_V3_SHAPE": "kimi_k2", "DEEPSEEK_V3_BATCH": "1024"},
                ["--ranks", "16", "--stages", "16", "--schedule", "1f1b", "--microbatches", "16",
                 "--dp", "64", "--ep", "64"],
                "Kimi-K2-shaped 1T MoE (61 layers, 384 routed experts top-8), 4,096 tokens a sample, 1,024 ranks: "
                "pp 16 x dp 64 (FSDP), experts over ep 64 (6 of 384 per rank), 1F1B, 16 microbatches of 1 sample "
                "per replica (global batch 1024)"),
}

# what the model's authors or peers published for it, and why the plan here differs
PEERS = {
    "deepseek_v3": {
        "peer": "DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2): 2,048 H800 GPUs, PP 16 (DualPipe), "
                "EP 64 over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism; recomputation of RMSNorm and the "
                "MLA up-projections, FP8 activations. torchtitan's deepseek_v3_671b config: FSDP over every rank, "
                "expert parallelism, selective (op) activation checkpointing, 4,096 tokens.",
        "differences": "The same shape of layout at a quarter of the GPUs: pp 16 (1F1B here; DualPipe's two "
                       "directions are tracepp's dualpipev) and experts over 32 of the data-parallel ranks instead of "
                       "64. tracepp trains as torchtitan does (fp32 master weights, gradients and optimizer state, "
                       "FSDP2 gathering bf16 copies: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) where "
                       "DeepSeek keeps FP8 activations and ZeRO-1, so its figures are higher per parameter; the "
                       "checkpointing the split chose (full on the stages holding most microbatches, selective or "
                       "none on the last) stands in for DeepSeek's cheaper selective recomputation.",
    },
    "llama3_405b": {
        "peer": "The Llama 3 Herd of Models (arXiv 2407.21783, table 4): 16,384 H100s at 8K sequences, TP 8, CP 1, "
                "PP 16, DP 128 (FSDP with parameters kept unsharded after forward); interleaved 1F1B; no activation "
                "checkpointing named for the 8K stage.",
        "differences": "The same tp 8 x pp 16 at 1/32 of the data parallelism (dp 4: 512 GPUs). A rank's weights are "
                       "the same 1/128 of the model; its optimizer state is 1/4 of a stage's, where Meta's is 1/128, "
                       "so tracepp's figure needs the checkpointing the split chose to stay under 80 GB.",
    },
    "kimi_k2": {
        "peer": "Kimi K2 technical report (arXiv 2507.20534, section 2.4): H800s, PP 16 with virtual stages, EP 16, "
                "ZeRO-1 data parallelism, selective recomputation (LayerNorm, SwiGLU, MLA up-projections), FP8 "
                "storage of some activations and CPU offload of the rest; any multiple of 32 nodes.",
        "differences": "pp 16 here too; experts over ep 64 (6 of 384 per rank) where Kimi uses ep 16 (24 per rank): "
                       "with fp32 master weights, gradients and optimizer state and no offload, 16-way expert "
                       "parallelism would hold four times the expert state a rank can afford in 80 GB.",
    },
}


def _communicate(process) -> tuple:
    """(stdout, stderr) of ``process``, read while it runs; its own resource usage (``os.wait4``: wall-clock
    independent CPU seconds and its peak RSS, not its siblings') lands in ``process.usage``."""
    import threading

    chunks = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda key=key, stream=stream: chunks[key].append(stream.read()))
               for key, stream in (("out", process.stdout), ("err", process.stderr))]
    for reader in readers:
        reader.start()
    _pid, status, process.usage = os.wait4(process.pid, 0)
    for reader in readers:
        reader.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    return "".join(chunks["out"]), "".join(chunks["err"])


def plan_case(name: str, root: str) -> dict:
    model, env_extra, options, case = CASES[name]
    out = os.path.join(root, name)
    command = [sys.executable, "-m", "tracepp", "split", os.path.join(HERE, model), "-o", out, *options,
               "--precision", "bf16", "--device", "cuda", "--optimizer", "adamw",
               "--activation-checkpointing", "auto", "--memory-limit", LIMIT]
    env = dict(os.environ, PYTHONPATH=REPO, **env_extra)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = _communicate(process)
    wall = time.perf_counter() - start
    usage = process.usage
    record = {"case": case, "command": " ".join(command[3:]), "environment": env_extra, "wall_s": round(wall, 1),
              "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
              "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "returncode": process.returncode,
              **PEERS[name]}
    if process.returncode != 0:
        record["error"] = stderr.strip().splitlines()[-1] if stderr.strip() else stdout[-2000:]
        return record
    with open(os.path.join(out, "manifest.json")) as handle:
        manifest = json.load(handle)
    memory = manifest["memory"]
    ranks = memory["ranks"]
    record.update({
        "parameters_b": round(sum(s["num_params"] for s in manifest["stages"]) / 1e9, 1),
        "layout": manifest["plan"].get("mesh"), "schedule": manifest["plan"]["schedule"],
        "microbatches": manifest["plan"]["num_microbatches"],
        "activation_checkpointing": manifest["run_options"]["activation_checkpointing"],
        "peak_gb_per_rank": [round(r["peak_bytes"] / 1e9, 2) for r in ranks],
        "max_peak_gb": round(max(r["peak_bytes"] for r in ranks) / 1e9, 2),
        "fits_80gb": max(r["peak_bytes"] for r in ranks) <= 80e9,
        "parts_gb_of_the_largest": {k: round(v / 1e9, 2) for k, v in
                                    max(ranks, key=lambda r: r["peak_bytes"])["parts"].items()},
        "at": [r["at"] for r in ranks], "notes": memory.get("notes", []),
        "alternatives_max_gb": {mode: round(max(peaks) / 1e9, 1) for mode, peaks in
                                (memory.get("alternatives") or {}).items()},
    })
    return record


def table(result: dict) -> str:
    """docs/memory.md's tables from a result file: the plans, then each beside what its peers published."""
    lines = ["| model | layout | checkpointing per stage | peak per rank (max) | largest rank's parts (GB) | "
             "planned in (wall / CPU / RSS) |", "| --- | --- | --- | --- | --- | --- |"]
    peers = []
    titles = {"deepseek_v3": "DeepSeek-V3", "llama3_405b": "Llama 3 405B", "kimi_k2": "Kimi-K2-shaped MoE"}
    for name, row in zip(result.get("names") or CASES, result["cases"]):
        title = titles.get(name, name)
        if "error" in row:
            lines.append(f"| {title} | - | - | failed: {row['error']} | - | {row['wall_s']} s |")
            continue
        mesh = row["layout"] or {}
        layout = " x ".join(f"{dim} {mesh[dim]}" for dim in ("pp", "dp", "tp", "ep", "cp") if mesh.get(dim, 1) > 1)
        runs = [(mode, len(list(group))) for mode, group in groupby(row["activation_checkpointing"].split(","))]
        checkpointing = ", ".join(f"{mode} x {count}" if count > 1 else mode for mode, count in runs)
        parts = ", ".join(f"{k} {v:g}" for k, v in row["parts_gb_of_the_largest"].items() if v)
        lines.append(f"| {title} ({row['parameters_b']:g}B) | {layout}, {row['schedule']}, "
                     f"{row['microbatches']} microbatches | {checkpointing} | {row['max_peak_gb']:g} GB "
                     f"({'fits' if row['fits_80gb'] else 'over'} 80 GB) | {parts} | {row['wall_s']:g} s / "
                     f"{row['cpu_s']:g} s / {row['peak_rss_gb']:g} GB |")
        peers.append(f"- **{title}.** {row['peer']} {row['differences']}")
    return "\n".join(lines) + "\n\n" + "\n".join(peers)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--table", metavar="RESULT", help="print docs/memory.md's tables from a result file")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as handle:
            print(table(json.load(handle)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.cases.split(","):
            record = plan_case(name, root)
            rows.append(record)
            print(f"{name}: {record.get('max_peak_gb', '-')} GB at most per rank "
                  f"({record.get('activation_checkpointing', record.get('error'))}); planned in {record['wall_s']} s "
                  f"wall, {record['cpu_s']} s CPU, {record['peak_rss_gb']} GB", flush=True)
    path = write_result(args.out, "memory_plans", {"limit": LIMIT, "names": args.cases.split(","), "cases": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
