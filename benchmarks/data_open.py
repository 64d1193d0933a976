"""Opening a pretraining corpus of shards: time and memory per rank (``run.py --data``).

    python -m benchmarks.data_open [--shards 1000] [--tokens 100000000] [--batch 64] [--seq 1024]
        [--steps 200] [--rounds 3] [--folder DIR] [--out benchmarks/results]

Writes ``--shards`` sparse llm.c shards of ``--tokens`` uint16 tokens each (a header, then ``truncate``: 200 MB
each on paper, no blocks on disk; FineWeb-scale with the defaults: 1,000 x 100M = 10^11 tokens) into a
temporary folder (or ``--folder``), then, in a fresh process per round and per ``--data-order``, builds the
training source as every rank does (``TokenBatches``: glob, headers, fingerprints, the vocabulary sample) and
reads ``--steps`` batches of ``--batch`` windows of ``--seq`` tokens. Recorded per run: the open time, the
resident memory before and after opening and its peak over the run (``/proc/self/status`` VmRSS and VmHWM), the
median time to build a batch, and the open file descriptors (the maps kept open are a quarter of the soft
limit on descriptors: run under ``ulimit -n 1024`` to see the common default's 256). The holes of a sparse file read as zeros from the
page cache, so the batch times are those of hot data, not of a disk.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

_WORKER = r"""
import json, os, sys, time

def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

pattern, order, batch, seq, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from tracepp.runtime.data import TokenBatches
manifest = {"token_input": {"leaf_index": 0, "path": "args[0]", "batch": batch, "seq": seq, "vocab": 50304},
            "root_inputs": []}
before = status("VmRSS:")
start = time.perf_counter()
source = TokenBatches(pattern, manifest, seed=0, order=order)
opened = time.perf_counter() - start
after_open = status("VmRSS:")
times = []
for step in range(steps):
    start = time.perf_counter()
    source(step)
    times.append(time.perf_counter() - start)
print(json.dumps({"order": order, "open_s": opened, "rss_before": before, "rss_after_open": after_open,
                  "peak_rss": status("VmHWM:"), "rss_end": status("VmRSS:"), "batch_s": sorted(times)[len(times) // 2],
                  "fds": len(os.listdir("/proc/self/fd")), "windows_per_pass": source.stream.windows[0],
                  "tokens": sum(len(f) for f in source.sources[0].files)}))
"""


def make_shards(folder: str, shards: int, tokens: int) -> str:
    import numpy as np

    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, tokens)
    for shard in range(shards):
        path = os.path.join(folder, f"fineweb_train_{shard:06d}.bin")
        if not os.path.exists(path) or os.path.getsize(path) != 1024 + 2 * tokens:
            with open(path, "wb") as handle:
                handle.write(header.tobytes())
                handle.truncate(1024 + 2 * tokens)
    return os.path.join(folder, "fineweb_train_*.bin")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where the sparse shards go (default: a temporary folder)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.folder or scratch
        os.makedirs(folder, exist_ok=True)
        pattern = make_shards(folder, args.shards, args.tokens)
        runs = []
        for round_ in range(args.rounds):
            for order in ("random", "epoch"):
                result = subprocess.run([sys.executable, "-c", _WORKER, pattern, order, str(args.batch),
                                         str(args.seq), str(args.steps)], capture_output=True, text=True,
                                        cwd=REPO, check=True)
                runs.append(json.loads(result.stdout))
                run = runs[-1]
                print(f"round {round_} {order:6s}: open {run['open_s']:.3f} s, RSS +"
                      f"{(run['rss_after_open'] - run['rss_before']) / 2**20:.1f} MB at open, peak +"
                      f"{(run['peak_rss'] - run['rss_before']) / 2**20:.1f} MB, batch {run['batch_s'] * 1e3:.2f} ms, "
                      f"{run['fds']} fds", flush=True)
    summary = {order: {"open_s_median": statistics.median(r["open_s"] for r in runs if r["order"] == order),
                       "open_s_max": max(r["open_s"] for r in runs if r["order"] == order),
                       "peak_rss_growth_mb_max": max((r["peak_rss"] - r["rss_before"]) / 2**20
                                                     for r in runs if r["order"] == order),
                       "batch_ms_median": 1e3 * statistics.median(r["batch_s"] for r in runs if r["order"] == order)}
               for order in ("random", "epoch")}
    import resource

    record = {"shards": args.shards, "tokens_per_shard": args.tokens, "batch": args.batch, "seq": args.seq,
              "steps": args.steps, "cpus": os.cpu_count(), "load_average": os.getloadavg(),
              "fd_soft_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "runs": runs,
              "summary": summary}
    print(json.dumps(summary, indent=1))
    write_result(args.out, f"data_open_nofile{record['fd_soft_limit']}", record)
    return record


if __name__ == "__main__":
    main()
