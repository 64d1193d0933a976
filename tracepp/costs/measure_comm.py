"""Point-to-point latency and bandwidth between neighbouring ranks: the simulator's communication calibration.

    torchrun --nproc-per-node R -m tracepp.costs.measure_comm [--json comm.json] [--sizes 4096,262144,4194304]

(``tracepp calibrate OUT`` launches this itself.) Every pair of neighbouring ranks (r, r+1), and the
wrap-around pair (0, R-1) of a V placement, plays ping-pong with messages of each size, using the calls the
tracepp runtime uses (its shared-memory rings between CPU ranks on one host, ``runtime/shm_p2p.py``, with
``--p2p auto``, the default; ``isend``/``irecv`` and ``wait`` on gloo; ``batch_isend_irecv`` on NCCL). A one-way time
is half the median round trip; a least-squares line ``time = latency + bytes / bandwidth`` over the sizes gives
each pair's latency and bandwidth. Ranks 0 and 1 then time the backend's all-reduce, all-gather and all-to-all
at the same sizes (what a tensor-parallel group and an expert-parallel exchange pay; ``collectives``, fitted per
ring step or per message). Rank 0 prints the table and writes ``{"backend", "serial", "world_size", "device",
"pairs": {"0-1": {"latency_s", "bandwidth_bytes_per_s", "points"}}, "collectives": {"all_reduce": {...},
"all_gather": {...}, "all_to_all": {...}}}``, the ``comm`` section of
``calibration.json``. ``serial``: the backend completes a rank's p2p ops in FIFO order (NCCL) or not (gloo).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

DEFAULT_SIZES = "4096,16384,65536,262144,1048576"


def _exchange(tensor, peer: int, send_first: bool, use_batch: bool, shm=None) -> None:
    import torch.distributed as dist

    if shm is not None and shm.carries(peer, send_first):  # the runtime's shared-memory rings (CPU, one host)
        (shm.isend if send_first else shm.irecv)(tensor, peer, 0).wait()
        return
    if use_batch:
        op = dist.P2POp(dist.isend if send_first else dist.irecv, tensor, peer)
        for work in dist.batch_isend_irecv([op]):
            work.wait()
        return
    (dist.isend if send_first else dist.irecv)(tensor, peer).wait()


def ping_pong(peer: int, leader: bool, size_bytes: int, rounds: int, device, use_batch: bool, shm=None) -> list:
    """One-way times (half round trips) of ``rounds`` ping-pongs of ``size_bytes`` with ``peer``."""
    import torch

    tensor = torch.zeros(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    times = []
    for index in range(rounds + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if leader:
            _exchange(tensor, peer, True, use_batch, shm)
            _exchange(tensor, peer, False, use_batch, shm)
        else:
            _exchange(tensor, peer, False, use_batch, shm)
            _exchange(tensor, peer, True, use_batch, shm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 2:  # the first two rounds set up connections and buffers
            times.append((time.perf_counter() - start) / 2)
    return times


def fit(points: list) -> dict:
    """``one-way time = latency + bytes / bandwidth`` by least squares of the *relative* error (weights 1 / time^2),
    so that small messages, whose time is mostly latency, are fitted as well as large ones; latency >= 0."""
    weights = [1.0 / (y * y) if y > 0 else 0.0 for _, y in points]
    total = sum(weights)
    if total <= 0 or len({x for x, _ in points}) < 2:
        latency = min(y for _, y in points)
        return {"latency_s": latency, "bandwidth_bytes_per_s": None,
                "points": [{"bytes": x, "one_way_s": y} for x, y in points]}
    mean_x = sum(w * x for w, (x, _) in zip(weights, points)) / total
    mean_y = sum(w * y for w, (_, y) in zip(weights, points)) / total
    var = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points)) / var if var else 0.0
    slope = max(slope, 0.0)
    latency = mean_y - slope * mean_x
    if latency < 0:  # a latency is never negative: through the smallest message instead
        smallest = min(points)
        latency = 0.0
        slope = smallest[1] / smallest[0] if smallest[0] else slope
    return {"latency_s": latency, "bandwidth_bytes_per_s": (1.0 / slope) if slope > 0 else None,
            "points": [{"bytes": x, "one_way_s": y} for x, y in points]}


def collective_points(op: str, group, size_bytes: int, rounds: int, device) -> float:
    """The median time of ``op`` ("all_reduce" of a ``size_bytes`` tensor, "all_gather" into one, or
    "all_to_all": an ``all_to_all_single`` of a whole ``size_bytes`` tensor with even splits, each member sending
    1/members of it to every member) over ``group``, each call timed between barriers, the slowest member's
    median (every member calls it)."""
    import torch
    import torch.distributed as dist

    members = dist.get_world_size(group)
    whole = torch.zeros(max(members, size_bytes // 4), dtype=torch.float32, device=device)
    piece = torch.zeros(whole.numel() // members, dtype=torch.float32, device=device)
    parts = [torch.empty_like(piece) for _ in range(members)]
    received = torch.empty(piece.numel() * members, dtype=torch.float32, device=device)
    even = whole[:received.numel()]  # all_to_all_single's even splits need a multiple of the members
    times = []
    for index in range(rounds + 2):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if op == "all_reduce":
            dist.all_reduce(whole, group=group)
        elif op == "all_to_all":
            dist.all_to_all_single(received, even, group=group)
        else:
            dist.all_gather(parts, piece, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 2:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest)


def collectives_on_two(sizes: list, rounds: int, device) -> dict:
    """Ranks 0 and 1's all-reduce and all-gather fitted per ring step (what tensor parallelism adds), for
    ``tracepp.costs.search.collective_s``: a 2-rank ring all-reduce is 2 steps of half the tensor, an all-gather 1,
    so the per-step latency is the fitted latency / steps and the per-step bandwidth the fitted bandwidth x
    (steps / 2). And their all-to-all (``all_to_all_single`` of a whole tensor, even splits: what expert
    parallelism's dispatch and combine run), for ``tracepp.costs.search.all_to_all_s``: over 2 ranks each sends
    one message of half the tensor, so it is fitted as one step too (a message's latency and bandwidth; over
    ep ranks the tuner prices ep - 1 such messages of 1/ep). Every rank calls it (the group is made on all of
    them); the others return {}."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    if dist.get_rank() not in (0, 1):
        return {}
    out = {"ranks": 2}
    for op, steps in (("all_reduce", 2), ("all_gather", 1), ("all_to_all", 1)):
        line = fit([(size, collective_points(op, group, size, rounds, device)) for size in sizes])
        bandwidth = line["bandwidth_bytes_per_s"]
        out[op] = {"step_latency_s": line["latency_s"] / steps,
                   "step_bandwidth_bytes_per_s": bandwidth * steps / 2 if bandwidth else None,
                   "points": line["points"]}
    return out


def neighbour_pairs(world: int) -> list:
    return sorted({(r, r + 1) for r in range(world - 1)} | ({(0, world - 1)} if world > 2 else set()))


def main(argv=None) -> None:
    import torch
    import torch.distributed as dist

    from tracepp.runtime import cpu_binding, shm_p2p

    parser = argparse.ArgumentParser(prog="python -m tracepp.costs.measure_comm", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--p2p", default="auto", choices=list(shm_p2p.MODES),
                        help="CPU: the transport run.py's --p2p picks (default auto: shared memory on one host)")
    args = parser.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("run under torchrun with at least 2 processes")
    sizes = [int(s) for s in args.sizes.split(",")]
    shm = None
    if not use_cuda:
        peers = {b if a == rank else a for a, b in neighbour_pairs(world) if rank in (a, b)}
        ring = max(shm_p2p.DEFAULT_RING_MB * 2**20, 2 * max(sizes) + 2 * shm_p2p.ALIGN)
        shm, note = shm_p2p.connect(rank, peers, peers, ring, args.p2p, own_core=cpu_binding.has_own_core())
        if note and rank == 0:
            print(f"note: {note}", flush=True)
    results = {}
    for low, high in neighbour_pairs(world):  # every rank walks the same pairs in the same order; only the pair plays
        points = []
        for size in sizes:
            if rank in (low, high):
                times = ping_pong(high if rank == low else low, rank == low, size, args.rounds, device, use_cuda,
                                  shm)
                points.append((size, statistics.median(times)))
            dist.barrier()
        if rank == low:
            results[f"{low}-{high}"] = fit(points)
    collectives = collectives_on_two(sizes, args.rounds, device)  # what a tp group of this machine would pay
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {key: value for part in gathered for key, value in part.items()}
        report = {"backend": dist.get_backend(), "transport": "shm" if shm is not None else dist.get_backend(),
                  "serial": use_cuda, "world_size": world,
                  "device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "pairs": merged,
                  "collectives": collectives, "sizes": sizes, "rounds": args.rounds}
        for key, value in sorted(merged.items()):
            bandwidth = value["bandwidth_bytes_per_s"]
            print(f"ranks {key}: latency {value['latency_s'] * 1e6:.1f} us, bandwidth "
                  + (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "unmeasurable (no slope)"), flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
