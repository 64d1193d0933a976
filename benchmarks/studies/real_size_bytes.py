"""Each family's ``--tp 2`` traffic beside Megatron's plan at the size people train, not the zoo's tiny one: the
config class's default size (``benchmarks/default_config_model.py``: Llama 2 7B, Gemma 2/3/4 at 2,304 wide, ...),
planned on meta tensors at pp 2 x tp 2 (4 microbatches of 1 x 2,048 tokens, bf16). Plans differ with size: heads
narrower than the hidden size, latents a small share of a layer, a gate a small share; the tiny configs of
``megatron_bytes`` do not show them. Per model: each decoder layer's bytes per microbatch and Megatron's for it
(``split.plan_cost``), the worst ratio, the stages' shares of parameters and the split's wall time::

    nice -n 10 python -m benchmarks.studies.real_size_bytes [--models llama,gemma4_text] [--timeout 900]

Another checkout's planner against the same models: its Python (whose ``tracepp`` is that checkout) runs this file,
``--label _before`` names the result.

writes ``benchmarks/results/<time>_real_size_bytes.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ["llama", "mistral", "qwen3", "gemma2", "gemma3_text", "gemma4_text"]


def measure(name: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        started = time.time()
        command = [sys.executable, "-m", "tracepp.cli", "split", os.path.join(REPO, "benchmarks", "default_config_model.py"),
                   "--out", out, "--ranks", "2", "--microbatches", "4", "--tp", "2", "--precision", "bf16",
                   "--device", "cuda"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd="/tmp",
                                  env=dict(os.environ, TRACEPP_DEFAULT_FAMILY=name))
        except subprocess.TimeoutExpired:
            return {"model": name, "error": f"over {timeout:.0f} s"}
        if done.returncode:
            lines = done.stderr.strip().splitlines()
            said = [line for line in lines if line.startswith("tracepp")]  # the CLI's own message, not a warning
            return {"model": name, "error": (said or lines or [f"exit {done.returncode}, no output"])[-1][:300]}
        with open(os.path.join(out, "manifest.json")) as handle:
            tp = json.load(handle)["tp"]
    layers: dict = {}  # a layer on two stages (or called on both) summed, as megatron_bytes sums it
    for stage in tp["stages"]:
        for layer, (moved, megatron) in stage["layers"].items():
            before = layers.get(layer, (0, None))
            layers[layer] = (before[0] + moved, before[1] if megatron is None else megatron + (before[1] or 0))
    ratios = [moved / megatron for moved, megatron in layers.values() if megatron]
    return {"model": name, "seconds": round(time.time() - started, 1), "layers": layers,
            "share": [stage["share"]["params"] for stage in tp["stages"]],
            "worst": max(ratios) if ratios else None, "best": min(ratios) if ratios else None,
            "replicated": [reason for stage in tp["stages"] for reason in stage["replicated"]][:5]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--label", default="", help="added to the result's file name (a run of another checkout)")
    args = parser.parse_args(argv)
    records = []
    out = os.path.join(REPO, "benchmarks", "results", f"{time.strftime('%Y%m%d-%H%M%S')}_real_size_bytes{args.label}.json")
    for name in args.models.split(","):
        record = measure(name, args.timeout)
        records.append(record)
        print(f"{name}: " + (record["error"] if "error" in record else
                             f"layers {record['best']:.2f}x - {record['worst']:.2f}x Megatron, share {record['share']}, "
                             f"{record['seconds']} s" if record["worst"] is not None else "no layer compared"),
              flush=True)
        with open(out, "w") as handle:
            json.dump({"what": "tp 2 bytes per microbatch per decoder layer beside Megatron's plan, default-size "
                               "configs planned on meta", "records": records}, handle, indent=1)
    print(f"results: {os.path.relpath(out, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
