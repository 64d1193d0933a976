"""tracepp's executor against the floor loop, step by step in the same processes: what tracepp's runtime costs.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node R -m benchmarks.studies.floor_pairs OUT_DIR [--pairs 40] [--json F]

The suite's ``--floor`` runs tracepp and the floor loop (``benchmarks/floor_worker.py``) as separate jobs, so their
ratio carries the machine's drift between runs (rounds 10 - 40% apart on the project's VM). Here every rank holds both:
tracepp's ``Pipeline`` on OUT_DIR (the public API, ``examples/own_loop.py``; imported from ``tracepp.runtime``, of which
the folder's ``tracepp_runtime`` is a copy, so that it sees the CPU binding this process made) and a ``FloorRank`` on the same folder
(its own copy of the stages, its own shared-memory rings), and runs their steps alternately, the order flipping every
pair, a barrier between any two steps. A step is each side's pipeline step, plain SGD (``torch.optim.SGD``) over its
rank's parameters, and one all-reduce of a scalar (the floor's loss; for tracepp its stop agreement, as run.py's
loop). Timed on the last stage's rank. Both train the same data from the same weights; their losses must agree.

Prints the median over pairs of tracepp's step over the floor's (and quartiles), each side's median step, and writes
``--json`` with every pair.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3, help="pairs dropped")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    out_dir = os.path.abspath(args.out_dir)
    from tracepp.runtime.cpu_binding import bind

    bind("auto")  # before gloo's threads start, as run.py does
    from tracepp.runtime.pipeline import Pipeline  # the runtime the folder's copy is made from: one binding state
    from benchmarks.floor_worker import FloorRank

    pipe = Pipeline(out_dir, check_finite=False)  # as run.py --on-nonfinite continue
    rank = dist.get_rank()
    floor = FloorRank(out_dir, rank, "shm", 300.0)
    tp_opt = torch.optim.SGD(list(pipe.parameters()), lr=args.lr)
    floor_params = [p for s in floor.own for p in floor.params[s]]
    for param in floor_params:
        param.grad = None
    fl_opt = torch.optim.SGD(floor_params, lr=args.lr)
    reports = floor.last in floor.own

    def tracepp_step(step: int):
        inputs, kwargs, target = pipe.user.batch(step)
        dist.barrier()
        start = time.perf_counter()
        loss = pipe.step(inputs, kwargs, target)
        tp_opt.step()
        pipe.zero_grad()
        dist.all_reduce(torch.zeros(()))  # run.py's per-step stop agreement
        return time.perf_counter() - start, None if loss is None else float(loss)

    def floor_step(step: int):
        floor.load_batch(step)
        dist.barrier()
        start = time.perf_counter()
        floor.step()
        fl_opt.step()
        fl_opt.zero_grad(set_to_none=True)
        dist.all_reduce(floor.step_loss)
        return time.perf_counter() - start, float(floor.step_loss)

    pairs = []
    for index in range(args.pairs + args.warmup):
        sides = [("tracepp", tracepp_step), ("floor", floor_step)]
        if index % 2:
            sides.reverse()
        found = {name: run(index) for name, run in sides}
        if index >= args.warmup:
            pairs.append({"pair": index, "first": sides[0][0], **{f"{n}_s": t for n, (t, _l) in found.items()},
                          **{f"{n}_loss": l for n, (_t, l) in found.items()}})
    dist.barrier()
    if reports:
        ratios = sorted(p["tracepp_s"] / p["floor_s"] for p in pairs)
        n = len(ratios)
        same = all(abs(p["tracepp_loss"] - p["floor_loss"]) <= 1e-4 * max(1.0, abs(p["floor_loss"])) for p in pairs)
        summary = {"folder": out_dir, "pairs": pairs, "tracepp_over_floor": statistics.median(ratios),
                   "quartiles": [ratios[n // 4], ratios[(3 * n) // 4]],
                   "tracepp_s": statistics.median(p["tracepp_s"] for p in pairs),
                   "floor_s": statistics.median(p["floor_s"] for p in pairs), "same_losses": same}
        print(f"{os.path.basename(os.path.dirname(out_dir)) or out_dir}: tracepp / floor {summary['tracepp_over_floor']:.3f} "
              f"[{ratios[n // 4]:.3f} - {ratios[(3 * n) // 4]:.3f}] over {n} pairs; tracepp "
              f"{summary['tracepp_s'] * 1000:.1f} ms, floor {summary['floor_s'] * 1000:.1f} ms; same losses: {same}",
              flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(summary, handle, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
