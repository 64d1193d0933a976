"""FSDP collectives and step time per step: tracepp's once-per-step layout against reducing every microbatch.

tracepp keeps a stage's parameters whole from its first forward to its last backward of the step and reduces
gradients once (runtime/mesh.py). This runs the same data-parallel pipeline both ways and reports, per rank,
the FSDP all-gathers and reduce-scatters per step (counted by wrapping ``torch.distributed``'s
``all_gather_single``/``reduce_scatter_single``, which FSDP2 calls) and the median step time::

    tracepp split examples/gpt.py -o out_dp --ranks 2 --dp 2 --microbatches 4
    torchrun --nproc-per-node 4 -m benchmarks.studies.dp_sync out_dp --steps 8

``per-microbatch`` sets ``set_requires_gradient_sync``/``set_reshard_after_backward``/``set_is_last_backward``
True before every backward (FSDP2's defaults), so each microbatch reshards, re-gathers and reduces.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

COUNTS = {"all_gather": 0, "reduce_scatter": 0}


def _count(name: str, function):
    def counted(*args, **kwargs):
        COUNTS[name] += 1
        return function(*args, **kwargs)
    return counted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.folder))
    import tracepp_runtime
    from tracepp_runtime import mesh as dp_mesh
    from tracepp_runtime.launch import user_batch

    dist.all_gather_single = _count("all_gather", dist.all_gather_single)
    dist.reduce_scatter_single = _count("reduce_scatter", dist.reduce_scatter_single)
    pipe = tracepp_runtime.Pipeline(args.folder)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    once_per_step = pipe.executor.before_backward
    results = {}
    for mode in ("once-per-step", "per-microbatch", "once-per-step", "per-microbatch"):
        pipe.executor.before_backward = (once_per_step if mode == "once-per-step" else
                                         lambda stage, mb: dp_mesh.set_last_backward(pipe.stages[stage], True))
        times = []
        for step in range(args.steps):
            inputs, kwargs, target = user_batch(pipe.user, step, True)
            dist.barrier()
            before = dict(COUNTS)
            start = time.perf_counter()
            pipe.step(inputs, kwargs, target)
            pipe.sync_shared_grads()
            optimizer.step()
            pipe.zero_grad()
            times.append(time.perf_counter() - start)
            counts = {k: COUNTS[k] - before[k] for k in COUNTS}
        times = sorted(times[1:])  # the first step of each mode warms up
        results.setdefault(mode, []).append({"median_step_s": times[len(times) // 2], **counts})
    gathered = [None] * pipe.world_size
    dist.all_gather_object(gathered, {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "results": results})
    if pipe.rank == 0:
        print(json.dumps({"microbatches": pipe.manifest["plan"]["num_microbatches"],
                          "stages_per_rank": len(pipe.stages), "device": str(pipe.device),
                          "ranks": gathered}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
