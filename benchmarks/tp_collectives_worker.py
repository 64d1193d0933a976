"""Measured against predicted: the tuner's price of tensor-parallel collectives (``tracepp.costs.search.
collective_s``: ring steps priced from ranks 0 and 1's fitted all-reduce and all-gather, as ``tracepp
calibrate`` records them) next to gloo's own all-reduce and all-gather of the same tensors over all ranks of this
torchrun. Run by ``benchmarks/tensor_parallel.py collectives`` with 2 and 4 processes:

    torchrun --nproc-per-node T -m benchmarks.tp_collectives_worker --json result.json

With 2 processes the price is the fit itself (a check of the fit); with 4 it extrapolates the ring to 4 ranks.
Each size: the median of 30 calls after 2 warm-ups, each between barriers, the slowest rank's median.
"""
from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tracepp.costs.measure_comm import collective_points, collectives_on_two
from tracepp.costs.search import collective_s

SIZES = (16384, 131072, 1048576, 4194304)  # bytes of the whole tensor: one layer's output at small to large sizes
ROUNDS = 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    fitted = collectives_on_two(list(SIZES), ROUNDS, device)
    shared = [None] * world
    dist.all_gather_object(shared, fitted)
    fitted = shared[0]
    links = {op: (fitted[op]["step_latency_s"], fitted[op]["step_bandwidth_bytes_per_s"])
             for op in ("all_reduce", "all_gather")}
    everyone = dist.new_group(list(range(world)))
    rows = []
    for size in SIZES:
        row = {"bytes": size}
        for op in ("all_reduce", "all_gather"):
            measured = collective_points(op, everyone, size, ROUNDS, device)
            predicted = collective_s(op, 1, size, world, links)
            row[op] = {"measured_s": measured, "predicted_s": predicted,
                       "predicted_over_measured": round(predicted / measured, 3)}
        rows.append(row)
    if rank == 0:
        with open(args.json, "w") as handle:
            json.dump({"world": world, "cores": os.cpu_count(), "fitted_on_ranks_0_1": fitted, "rows": rows},
                      handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
