"""Train a benchmark model with torch.distributed.pipelining (the baseline tracepp is compared against).

    torchrun --nproc-per-node R -m benchmarks.torch_worker --model-file m.py --schedule 1f1b \\
        --microbatches 8 --stages-per-rank 1 --steps 12 --metrics m.jsonl [--memory-dir DIR] [--device cpu]
        [--cpu-bind auto|none]

Same model file, same split (``SplitPoint.BEGINNING`` at the model file's ``split_points``: the FQNs that
tracepp splits at), loop placement (stage i on rank i % R, as tracepp's loop placement), the matching
``Schedule*`` class, mean cross-entropy per microbatch with ``scale_grads=True`` (so gradients are those of
the full-batch mean, as in tracepp), plain SGD over the rank's stage parameters.

The step time is taken on the rank that holds the last stage, as tracepp's runtime does: wall time of
``schedule.step`` plus ``optimizer.step``/``zero_grad`` (CUDA synchronised at both ends). The batch is built
and moved to the device before the clock starts. One JSON line per step: ``step``, ``loss``, ``step_time_s``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.gpt_model import load_model_file
from benchmarks.memory import PeakMemory, cuda_device_or_die, write_memory

SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
             "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", required=True)
    parser.add_argument("--schedule", required=True, choices=sorted(SCHEDULES))
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--memory-dir", default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--cpu-bind", default="none", choices=["auto", "none"],
                        help="auto: bind each rank to its share of the cores as tracepp's run.py does by default "
                             "(tracepp.runtime.cpu_binding); none (default): as torch runs")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    from torch.distributed import pipelining as pp

    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = cuda_device_or_die()
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout),
                                device_id=device)
    else:
        device = torch.device("cpu")
        if args.cpu_bind == "auto":  # before gloo's threads start, as run.py does
            from tracepp.runtime.cpu_binding import bind
            bind("auto")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    user = load_model_file(args.model_file)
    class_name, stages_per_rank = SCHEDULES[args.schedule]
    num_stages = world * stages_per_rank
    split_points = list(user.split_points)
    if len(split_points) != num_stages - 1:
        raise SystemExit(f"the model file has {len(split_points) + 1} stages; {args.schedule} on {world} ranks "
                         f"needs {num_stages}")
    model = user.model()
    inputs, kwargs, target = user.batch(0)
    mb_args = tuple(t.tensor_split(args.microbatches)[0] for t in inputs)
    pipe = pp.pipeline(model, mb_args=mb_args, mb_kwargs=kwargs or None,
                       split_spec={fqn: pp.SplitPoint.BEGINNING for fqn in split_points})
    if pipe.num_stages != num_stages:
        raise SystemExit(f"torch split the model into {pipe.num_stages} stages, expected {num_stages}")
    local = [rank + k * world for k in range(stages_per_rank)]  # loop placement, as tracepp's
    stages = [pp.build_stage(pipe.get_stage_module(i).to(device), i, pipe.info(), device) for i in local]
    del model, pipe
    schedule_class = getattr(pp, class_name)
    if stages_per_rank == 1:
        schedule = schedule_class(stages[0], args.microbatches, loss_fn=user.loss_fn, scale_grads=True)
    else:
        schedule = schedule_class(stages, args.microbatches, loss_fn=user.loss_fn, scale_grads=True)
    params = [p for stage in stages for p in stage.submod.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr)
    has_first, has_last = 0 in local, num_stages - 1 in local
    memory = PeakMemory(device) if args.memory_dir else None  # the last MEMORY_STEPS steps: untimed by the harness
    for step in range(args.steps):
        inputs, kwargs, target = user.batch(step)
        inputs = tuple(t.to(device) for t in inputs)
        target = target.to(device)
        losses = [] if has_last else None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if memory is not None:
            memory.at_step(step, args.steps)
        start, cpu_start = time.perf_counter(), time.process_time()
        step_args = inputs if has_first else ()
        step_kwargs = dict(kwargs) if has_first else {}
        schedule.step(*step_args, target=target if has_last else None, losses=losses, return_outputs=False,
                      **step_kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        cpu_time = time.process_time() - cpu_start
        if has_last:
            loss = float(torch.stack([l.detach().float() for l in losses]).mean())
            with open(args.metrics, "a") as handle:
                handle.write(json.dumps({"step": step, "loss": loss, "step_time_s": elapsed,
                                         "cpu_time_s": cpu_time}) + "\n")
    if memory is not None:
        write_memory(args.memory_dir, rank, memory.stop())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
