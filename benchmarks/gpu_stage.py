"""One real-size pipeline stage on one GPU: tracepp (eager and --compile) against the same layers as a plain loop.

    python -m benchmarks.gpu_stage [--layers 8] [--microbatches 4] [--steps 8] [--json out.json]

The stage is ``benchmarks/llama_stage_model.py``: 8 of Llama-7B's 32 decoder layers (hidden 4096, 32 heads,
intermediate 11008; 1.6B parameters), one sample of 4096 tokens per microbatch. Every system trains it with bf16
compute, fp32 master weights and AdamW (lr 1e-4), and the weights are initialised on the GPU's host process, never
as part of a whole 7B model:

* ``tracepp``: ``tracepp split --ranks 1 --stages 1 --schedule 1f1b`` (one stage: F and B alternate per microbatch, as gradient accumulation does) and ``torchrun --nproc-per-node 1 run.py
  --precision bf16`` (the model file's ``optimizer()`` is AdamW); the step time is the runtime's own ``--metrics`` ``step_time_s``;
* ``tracepp --compile``: the same with ``--compile``;
* ``plain``: the module itself in this process, ``torch.autocast(bfloat16)`` forward, backward per microbatch
  (gradient accumulation), ``torch.optim.AdamW`` step; ``plain compiled`` wraps it in ``torch.compile``.

Reported per system: median step time over the steps after the first two (compilation and allocator warm-up),
tokens/s, peak ``torch.cuda.max_memory_allocated``, and MFU: model FLOPs (6 * params * tokens + 12 * layers *
hidden * seq * tokens) per second over the GPU's dense bf16 peak (``--peak-tflops``, default 989 for H100 SXM).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_FILE = os.path.join(HERE, "llama_stage_model.py")


def _stage_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_stage_model", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(name: str, times: list, peak_bytes, tokens: int, flops: float, peak_tflops: float) -> dict:
    timed = times[2:] if len(times) > 3 else times
    median = statistics.median(timed)
    achieved = flops / median / 1e12
    return {"system": name, "step_time_s": round(median, 5), "tokens_per_s": round(tokens / median, 1),
            "peak_memory_gb": None if peak_bytes is None else round(peak_bytes / 2**30, 2),
            "tflops": round(achieved, 1), "mfu": round(achieved / peak_tflops, 4),
            "all_step_times_s": [round(t, 5) for t in times]}


def plain_loop(steps: int, microbatches: int, compiled: bool, lr: float) -> tuple:
    """The stage as an ordinary module: bf16 autocast forward, backward per microbatch, AdamW; (times, peak)."""
    stage = _stage_module()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = stage.model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    forward = torch.compile(model) if compiled else model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(steps):
        (hidden,), _kwargs, target = stage.batch(step)
        chunks = hidden.to(device).tensor_split(microbatches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for chunk in chunks:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = forward(chunk)
            loss = stage.loss_fn(out, target[:chunk.shape[0]]) * (chunk.shape[0] / hidden.shape[0])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, optimizer, forward
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times, peak


def tracepp_run(work: str, steps: int, microbatches: int, compiled: bool, lr: float, extra: list) -> tuple:
    out = os.path.join(work, "out")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not os.path.isdir(out):
        split = [sys.executable, "-m", "tracepp", "split", MODEL_FILE, "-o", out, "--ranks", "1", "--stages", "1",
                 "--schedule", "1f1b", "--microbatches", str(microbatches)]
        started = time.perf_counter()
        done = subprocess.run(split, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"tracepp split failed:\n{done.stdout}\n{done.stderr[-4000:]}")
        print(f"split in {time.perf_counter() - started:.1f} s", flush=True)
    metrics = os.path.join(work, f"metrics_{'compile' if compiled else 'eager'}.jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(out, "run.py"), "--steps", str(steps), "--precision", "bf16",
               "--metrics", metrics, "--timeout", "900", *extra]
    if compiled:
        command.append("--compile")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1500)
    if done.returncode:
        raise RuntimeError(f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    with open(metrics) as handle:
        lines = [json.loads(line) for line in handle]
    peak = max((line.get("max_memory_allocated") or 0 for line in lines), default=0) or None
    return [line["step_time_s"] for line in lines], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    parser.add_argument("--systems", default="plain,tracepp,plain-compiled,tracepp-compiled")
    parser.add_argument("--tracepp-args", default="", help="extra run.py flags for the tracepp systems")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    stage = _stage_module()
    tokens = stage.BATCH * stage.SEQ
    flops = stage.flops_per_step(tokens)
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "layers": stage.LAYERS, "hidden": stage.HIDDEN, "seq": stage.SEQ,
              "batch": stage.BATCH, "microbatches": args.microbatches, "params": stage.num_params(),
              "tokens_per_step": tokens, "model_flops_per_step": flops, "peak_tflops": args.peak_tflops,
              "settings": "bf16 autocast compute, fp32 master weights, AdamW lr 1e-4, TF32 default",
              "systems": []}
    with tempfile.TemporaryDirectory() as work:
        for name in args.systems.split(","):
            try:
                if name.startswith("plain"):
                    times, peak = plain_loop(args.steps, args.microbatches, name.endswith("compiled"), args.lr)
                else:
                    times, peak = tracepp_run(work, args.steps, args.microbatches, name.endswith("compiled"),
                                              args.lr, args.tracepp_args.split())
                row = _summary(name, times, peak, tokens, flops, args.peak_tflops)
            except Exception as error:  # keep the other systems' numbers
                row = {"system": name, "error": str(error)[-4000:]}
            result["systems"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "all_step_times_s"}), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
