"""Which form of gloo's collectives should sequence parallelism use? The list forms (``all_gather`` into a list and
a ``cat``; ``reduce_scatter`` of a list of contiguous pieces) against the one-buffer forms
(``all_gather_into_tensor``; ``reduce_scatter_tensor`` of the pieces laid rank-major), on a [4, 128, 256] fp32
value split over the sequence (dim 1), with the all-reduce and a plain clone for scale. The forms run interleaved,
each after a barrier, their order flipped every iteration, so a spell of load on a shared machine falls on all of
them; the result also checks that each pair of forms gives the same values.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m benchmarks.studies.tp_collectives_forms [--iterations 300] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--shape", default="4,128,256")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    whole = torch.randn(*[int(v) for v in args.shape.split(",")])
    b, s, h = whole.shape
    shard = whole[:, : s // world].contiguous()

    def gather_list():
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard)
        return torch.cat(parts, 1)

    def gather_tensor():
        flat = shard.new_empty((world,) + tuple(shard.shape))
        dist.all_gather_into_tensor(flat.view(-1), shard.view(-1))
        return flat.movedim(0, 1).reshape(b, s, h)

    def scatter_list():
        pieces = [p.contiguous() for p in whole.chunk(world, 1)]
        out = torch.empty_like(pieces[0])
        dist.reduce_scatter(out, pieces)
        return out

    def scatter_tensor():
        flat = whole.view(b, world, s // world, h).movedim(1, 0).contiguous()
        out = whole.new_empty((b, s // world, h))
        dist.reduce_scatter_tensor(out.view(-1), flat.view(-1))
        return out

    def all_reduce():
        out = whole.clone()
        dist.all_reduce(out)
        return out

    forms = [("all_gather list + cat", gather_list), ("all_gather_into_tensor", gather_tensor),
             ("reduce_scatter list", scatter_list), ("reduce_scatter_tensor", scatter_tensor),
             ("all_reduce (clone + in place)", all_reduce), ("clone alone", whole.clone)]
    same = {"all_gather": bool(torch.equal(gather_list(), gather_tensor())),
            "reduce_scatter": bool(torch.equal(scatter_list(), scatter_tensor()))}
    totals = {name: [0.0, 0.0] for name, _fn in forms}
    for iteration in range(args.iterations):
        for name, fn in forms if iteration % 2 == 0 else forms[::-1]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            fn()
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += time.thread_time() - cpu
    if rank == 0:
        from benchmarks import write_result

        rows = {name: {"wall_us": wall / args.iterations * 1e6, "calling_thread_cpu_us": cpu / args.iterations * 1e6}
                for name, (wall, cpu) in totals.items()}
        for name, row in rows.items():
            print(f"{name:32s} wall {row['wall_us']:8.1f} us   calling thread's CPU {row['calling_thread_cpu_us']:7.1f} us")
        write_result(args.out, "tp_collectives_forms", {
            "shape": list(whole.shape), "world": world, "iterations": args.iterations, "same_values": same,
            "loadavg": list(os.getloadavg()), "cores": os.cpu_count(), "torch": torch.__version__, "forms": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
