"""What one message costs a pipeline on this machine, without tracepp: two ranks in lockstep, each computing
about C ms (a chain of 128 x 128 matmuls) and then exchanging one message with the other (gloo isend + irecv,
the receive posted before or after the compute), N times. The cycle's excess over the compute alone is what
a boundary message adds where the ranks wait on each other; a ping-pong between idle ranks does not show it.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.exchange_cost [--matmuls 60] [--bytes 16384] [--cycles 200]
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
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
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
    for placement in ("receive posted after the compute", "receive posted before the compute"):
        dist.barrier()
        cycles = []
        for index in range(args.cycles):
            start = time.perf_counter()
            early = placement.endswith("before the compute")
            if early:
                received = dist.irecv(receive, peer, tag=index)
            compute()
            if not early:
                received = dist.irecv(receive, peer, tag=index)
            sent = dist.isend(send, peer, tag=index)
            received.wait()
            sent.wait()
            cycles.append(time.perf_counter() - start)
        cycle_s = statistics.median(cycles[10:])
        if rank == 0:
            print(f"{placement}: compute alone {compute_s * 1e3:.3f} ms, cycle {cycle_s * 1e3:.3f} ms, "
                  f"excess per message {(cycle_s - compute_s) * 1e3:.3f} ms ({args.bytes} bytes)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
