"""Measured against predicted: the tuner's price of an expert-parallel all-to-all (``tracepp.costs.search.
all_to_all_s``: ep - 1 messages of 1/ep of the bytes a rank holds, priced from ranks 0 and 1's fitted all-to-all
as ``tracepp calibrate`` records it) next to gloo's own ``all_to_all_single`` of the same tensors (even splits)
over all ranks of this torchrun. Run by ``benchmarks/expert_parallel.py alltoall`` with 2 and 4 processes:

    torchrun --nproc-per-node E -m benchmarks.ep_alltoall_worker --json result.json

With 2 processes the price is the fit itself (a check of the fit); with 4 it extrapolates to 4 ranks. Each size:
the median of 30 calls after 2 warm-ups, each between barriers, the slowest rank's median.
"""
from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tracepp.costs.measure_comm import collective_points, collectives_on_two
from tracepp.costs.search import all_to_all_s

# bytes a rank holds: the (token, expert) rows of one block and microbatch, small to large (the zoo Mixtral's 16
# rows of 128 bytes is 2 KB; the benchmark Mixtral's 256 rows of 512 bytes 128 KB; 4096 tokens x top-8 x 7168
# bf16 of DeepSeek-V3 would be 470 MB)
SIZES = (16384, 131072, 1048576, 4194304)
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
    link = (fitted["all_to_all"]["step_latency_s"], fitted["all_to_all"]["step_bandwidth_bytes_per_s"])
    everyone = dist.new_group(list(range(world)))
    rows = []
    for size in SIZES:
        measured = collective_points("all_to_all", everyone, size, ROUNDS, device)
        predicted = all_to_all_s(1, size, world, link)
        rows.append({"bytes": size, "measured_s": measured, "predicted_s": predicted,
                     "predicted_over_measured": round(predicted / measured, 3)})
    if rank == 0:
        with open(args.json, "w") as handle:
            json.dump({"world": world, "cores": os.cpu_count(), "model": "(ep - 1) x (latency + bytes / ep / "
                       "bandwidth), one message of the 2-rank fit per step", "fitted_on_ranks_0_1": fitted,
                       "rows": rows}, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
