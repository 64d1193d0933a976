"""Where does a tracepp stage's step time go next to the same layers as a plain module? Kernel totals per system.

    python -m benchmarks.studies.gpu_profile_stage OUT_DIR [--json profile.json]

OUT_DIR is ``tracepp split benchmarks/llama_stage_model.py`` output (one stage). Both systems run one step
(forward and backward of every microbatch, bf16 autocast, no optimizer) under ``torch.profiler`` after two
warm-up steps; the report lists wall time, the sum of CUDA kernel time, and the kernels whose total differs most.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_stage import _stage_module


def _kernels(prof) -> dict:
    totals = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if event.device_type == torch.autograd.DeviceType.CUDA or "cuda" in str(event.device_type).lower():
            totals[event.key] = totals.get(event.key, 0.0) + cuda_us / 1e3
    return totals


def _profiled(step_fn, device) -> tuple:
    for _ in range(2):
        step_fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step_fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    return wall, _kernels(prof)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    stage = _stage_module()
    (hidden,), kwargs, target = stage.batch(0)
    microbatches = json.load(open(os.path.join(args.out_dir, "manifest.json")))["plan"]["num_microbatches"]

    model = stage.model().to(device)
    chunks = hidden.to(device).tensor_split(microbatches)

    def plain_step():
        for chunk in chunks:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(chunk)
            (stage.loss_fn(out, target[:chunk.shape[0]]) / microbatches).backward()
        model.zero_grad(set_to_none=True)

    plain_wall, plain = _profiled(plain_step, device)
    del model
    torch.cuda.empty_cache()

    import sys
    sys.path.insert(0, os.path.abspath(args.out_dir))
    import tracepp_runtime

    pipe = tracepp_runtime.Pipeline(args.out_dir, all_stages=True, device=device, precision="bf16")

    def tracepp_step():
        pipe.step((hidden,), kwargs, target)
        pipe.zero_grad(set_to_none=True)

    tracepp_wall, traced = _profiled(tracepp_step, device)
    keys = set(plain) | set(traced)
    diffs = sorted(((traced.get(k, 0.0) - plain.get(k, 0.0), k) for k in keys), key=lambda x: -abs(x[0]))
    report = {"plain_wall_ms": plain_wall * 1e3, "tracepp_wall_ms": tracepp_wall * 1e3,
              "plain_kernel_ms": sum(plain.values()), "tracepp_kernel_ms": sum(traced.values()),
              "largest_differences_ms": [{"kernel": k[:160], "tracepp_minus_plain_ms": round(d, 2),
                                          "plain_ms": round(plain.get(k, 0.0), 2),
                                          "tracepp_ms": round(traced.get(k, 0.0), 2)} for d, k in diffs[:15]]}
    print(json.dumps({k: v for k, v in report.items() if k != "largest_differences_ms"}))
    for row in report["largest_differences_ms"]:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
