"""What one message costs a pipeline on this machine, without tracepp: two ranks in lockstep, each computing
about C ms (a chain of 128 x 128 matmuls) and then exchanging one message with the other (isend + irecv,
the receive posted before or after the compute), N times, through gloo and through tracepp's shared-memory
rings (``tracepp.runtime.shm_p2p``), each rank bound to its own core as ``run.py`` binds it. The cycle's excess
over the compute alone is what a boundary message adds where the ranks wait on each other; a ping-pong between
idle ranks does not show it.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.studies.exchange_cost [--matmuls 60] [--bytes 16384] [--cycles 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matmuls", type=int, default=60, help="matmul + tanh per compute (60: about 6 ms here)")
    parser.add_argument("--bytes", type=int, default=16384, help="message size")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--transports", default="gloo,shm")
    args = parser.parse_args()
    from tracepp.runtime import cpu_binding, shm_p2p

    cpu_binding.bind("auto")  # before gloo's threads start, as run.py does
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    shm, _note = shm_p2p.connect(rank, {peer}, {peer}, 1 << 20, "shm", own_core=cpu_binding.has_own_core())
    torch.set_num_threads(1)
    a, w = torch.randn(128, 128), torch.randn(128, 128)

    def compute():
        x = a
        for _ in range(args.matmuls):
            x = torch.tanh(x @ w)
        return x

    alone = []
    for _ in range(50):  # both ranks compute at once, as in the cycles
        start = time.perf_counter()
        compute()
        alone.append(time.perf_counter() - start)
    compute_s = statistics.median(alone)
    send, receive = torch.zeros(args.bytes // 4), torch.zeros(args.bytes // 4)
    runs = [(transport, placement) for transport in args.transports.split(",")
            for placement in ("receive posted after the compute", "receive posted before the compute")]
    for transport, placement in runs:
        isend, irecv = (dist.isend, dist.irecv) if transport == "gloo" else (shm.isend, shm.irecv)
        dist.barrier()
        cycles = []
        for index in range(args.cycles):
            start = time.perf_counter()
            early = placement.endswith("before the compute")
            if early:
                received = irecv(receive, peer, tag=index)
            compute()
            if not early:
                received = irecv(receive, peer, tag=index)
            sent = isend(send, peer, tag=index)
            received.wait()
            sent.wait()
            cycles.append(time.perf_counter() - start)
        cycle_s = statistics.median(cycles[10:])
        if rank == 0:
            print(f"{transport}, {placement}: compute alone {compute_s * 1e3:.3f} ms, cycle {cycle_s * 1e3:.3f} ms, "
                  f"excess per message {(cycle_s - compute_s) * 1e3:.3f} ms ({args.bytes} bytes)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
