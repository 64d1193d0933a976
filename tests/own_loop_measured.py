"""A training loop of one's own through ``tracepp_runtime.Pipeline`` (the guide's, with AdamW), measured: every rank
runs this under torchrun and writes what it ran, what it recomputed and its measured peak beside the plan's.

    torchrun --nproc-per-node R tests/own_loop_measured.py OUT RESULT_PREFIX [--steps K]

The Pipeline is built with no arguments: the precision and activation checkpointing are the split's. The first step
counts the forward ops run again inside autograd's backward (``aten.rsqrt``, RMSNorm's, whose backward formula does
not call it): recomputation observed, not configured. The peak is torch's own ``MemTracker`` over every step
(``tracepp_runtime.memory.MeasuredPeak``), which shares no code with the plan's count. Each rank writes
``RESULT_PREFIX.rank<r>.json``.
"""
import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from util import RecomputedOps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("result")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.folder))
    import tracepp_runtime
    from tracepp_runtime.memory import MeasuredPeak

    pipe = tracepp_runtime.Pipeline(args.folder)  # the split's precision, checkpointing and fit check
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    counter = RecomputedOps()
    meter = MeasuredPeak(pipe)
    meter.start()
    losses = []
    for step in range(args.steps):
        inputs, kwargs, target = pipe.user.batch(step)
        with counter if step == 0 else contextlib.nullcontext():
            loss = pipe.step(inputs, kwargs, target)
        pipe.sync_shared_grads()
        optimizer.step()
        pipe.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    measured = meter.stop()
    planned = pipe.manifest["memory"]["ranks"][pipe.pp_rank]
    record = {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "precision": pipe.precision,
              "checkpointing": {str(k): v for k, v in pipe.checkpointing.items()}, "recomputed": counter.recomputed,
              "measured": measured["peak_bytes"], "predicted": planned["peak_bytes"],
              "ratio": measured["peak_bytes"] / planned["peak_bytes"], "method": measured["method"],
              "losses": losses}
    with open(f"{args.result}.rank{pipe.rank}.json", "w") as handle:
        json.dump(record, handle, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
