"""Point-to-point latency and bandwidth between neighbouring ranks, for the simulator's communication model.

    torchrun --nproc-per-node R -m benchmarks.calibrate_comm [--json comm.json] [--sizes 4096,1048576,16777216]

Every pair of neighbouring ranks (r, r+1), and the wrap-around pair of a V placement (0, R-1), plays ping-pong
with messages of each size, using the same calls the tracepp runtime uses (``isend``/``irecv`` on gloo,
``batch_isend_irecv`` on NCCL). A one-way transfer time is half the median round trip; a least-squares line
``time = latency + bytes / bandwidth`` over the sizes gives each pair's latency and bandwidth. Rank 0 prints the
table and writes the JSON ``{"pairs": {"0-1": {"latency_s": ..., "bandwidth_bytes_per_s": ...}}, ...}`` that the
simulator's communication model reads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _exchange(tensor: torch.Tensor, peer: int, send_first: bool, use_batch: bool) -> None:
    if use_batch:
        op = dist.P2POp(dist.isend if send_first else dist.irecv, tensor, peer)
        for work in dist.batch_isend_irecv([op]):
            work.wait()
        return
    (dist.isend if send_first else dist.irecv)(tensor, peer).wait()


def ping_pong(peer: int, leader: bool, size_bytes: int, rounds: int, device: torch.device, use_batch: bool) -> list:
    tensor = torch.zeros(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    times = []
    for index in range(rounds + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if leader:
            _exchange(tensor, peer, True, use_batch)
            _exchange(tensor, peer, False, use_batch)
        else:
            _exchange(tensor, peer, False, use_batch)
            _exchange(tensor, peer, True, use_batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 2:  # the first two rounds set up connections and buffers
            times.append((time.perf_counter() - start) / 2)
    return times


def fit(points: list) -> dict:
    """Least squares of one-way time against bytes: latency (intercept) and bandwidth (1 / slope)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
    latency = max(mean_y - slope * mean_x, 0.0)
    return {"latency_s": latency, "bandwidth_bytes_per_s": (1.0 / slope) if slope > 0 else float("inf"),
            "points": [{"bytes": x, "one_way_s": y} for x, y in points]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,262144,4194304,16777216", help="message sizes in bytes")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("run under torchrun with at least 2 processes")
    pairs = sorted({(r, r + 1) for r in range(world - 1)} | ({(0, world - 1)} if world > 2 else set()))
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for low, high in pairs:  # every rank walks the same pairs in the same order; only the pair plays
        points = []
        for size in sizes:
            if rank in (low, high):
                times = ping_pong(high if rank == low else low, rank == low, size, args.rounds, device, use_cuda)
                points.append((size, statistics.median(times)))
            dist.barrier()
        if rank == low:
            results[f"{low}-{high}"] = fit(points)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {key: value for part in gathered for key, value in part.items()}
        report = {"backend": dist.get_backend(), "world_size": world,
                  "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "pairs": merged}
        for key, value in sorted(merged.items()):
            print(f"ranks {key}: latency {value['latency_s'] * 1e6:.1f} us, "
                  f"bandwidth {value['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
