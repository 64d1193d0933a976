"""Several plans' steps in turn in the same processes: ``plan --tune --measure K``'s way to compare plans that are
closer to each other than the machine's drift between two runs.

    torchrun --nproc-per-node R -m tracepp.costs.measure_interleaved FOLDER ... --warmup W --steps S \\
        --metrics PREFIX [-- run.py's flags]

Why: on a shared machine the speed moves 10 - 40% within seconds to minutes (the project's 2-vCPU VM: the same
plan's runs a few seconds apart measured 71, 116 and 93 ms), so plans run one after the other in separate jobs,
even in paired rounds, cannot be told apart at a few percent. Here every rank builds every folder's pipeline (each
its own ``Pipeline``, stages, optimizer and message rings) and then runs one step of each in turn, the order
flipping every cycle, a barrier before each step: a spell of load falls on every plan within a second. All folders
must be plans of the same job for the same number of processes (what the tuner's candidates are).

A step is run.py's (``runtime/launch.py``): the folder's planned precision, checkpointing and optimizer unless the
flags after ``--`` say otherwise (``run_options.fill_defaults``), ``Pipeline.step``, the host-memory release, then
``launch._update`` (tied-weight sync, the norm check, the optimizer and scheduler steps, the ranks' stop agreement),
timed from before ``Pipeline.step`` to after the update on the rank that reports (the last stage's, first replica).
That rank writes ``PREFIX.plan<k>.jsonl``: one line per measured step (``step_time_s``, ``cpu_time_s``, ``cycle``,
``loss``), ``k`` the folder's position from 1. Every plan's stages are in memory at once: the caller checks they fit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m tracepp.costs.measure_interleaved",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--warmup", type=int, default=2, help="cycles dropped at the start")
    parser.add_argument("--steps", type=int, default=10, help="measured cycles (one step of every plan each)")
    parser.add_argument("--metrics", required=True, help="PREFIX of the per-plan JSON-lines files")
    args = parser.parse_args(argv)
    return args, rest


def _build(folder: str, rest: list, rank: int, steps: int) -> dict:
    """run.py's set-up of one folder (``launch.main`` and the start of ``launch.train``) without its loop."""
    from tracepp.runtime import launch
    from tracepp.runtime.loading import load_manifest
    from tracepp.runtime.optim import build_optimizer, build_scheduler
    from tracepp.runtime.pipeline import Pipeline
    from tracepp.runtime.run_options import fill_defaults

    args = launch.parse_args(rest + ["--steps", str(steps)])
    manifest = load_manifest(folder)
    fill_defaults(args, manifest)
    if args.precision == "fp16":  # run.py's dynamic loss scale is per job: not kept per plan here
        raise SystemExit(f"{folder}: fp16 plans are measured in rounds of their own runs (--measure-method rounds)")
    pipe = Pipeline(folder, rank=rank, timeout_s=args.timeout, precision=args.precision,
                    activation_checkpointing=args.activation_checkpointing, memory_check="off", compile=args.compile,
                    compile_cache=args.compile_cache, check_finite=args.on_nonfinite != "continue", load=args.load,
                    init=args.init, p2p=args.p2p, shm_ring_mb=args.shm_ring_mb)
    named = [(name, p) for name, p in pipe.named_parameters() if p.requires_grad]
    optimizer = scheduler = None
    if pipe.training and named:
        optimizer = build_optimizer(pipe.user, named, name=args.optimizer, lr=args.lr,
                                    weight_decay=args.weight_decay)
        scheduler = build_scheduler(pipe.user, optimizer, warmup=args.warmup, total_steps=args.steps)
    args.stop = launch.StopRequest()
    needs_norm = pipe.training and (args.clip_grad_norm is not None or args.on_nonfinite != "continue")
    reports = launch.reports_for_job(pipe)
    return {"pipe": pipe, "args": args, "optimizer": optimizer, "scheduler": scheduler, "needs_norm": needs_norm,
            "reports": reports}


def _step(plan: dict, step: int) -> tuple:
    """One of run.py's training steps of ``plan``: (seconds, CPU seconds, loss or None on other ranks)."""
    import torch.distributed as dist
    from tracepp.runtime import host_memory, launch

    pipe, args = plan["pipe"], plan["args"]
    inputs, kwargs, target = launch.user_batch(pipe.user, step, pipe.training)
    if dist.is_initialized():
        dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = pipe.step(inputs, kwargs, target)
    host_memory.release(pipe.device)
    if pipe.training:
        launch._update(pipe, args, step, result if plan["reports"] else None, None, plan["needs_norm"],
                       plan["optimizer"], plan["scheduler"])
    if pipe.device.type == "cuda":
        import torch

        torch.cuda.synchronize(pipe.device)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    loss = float(result) if plan["reports"] and result is not None and not isinstance(result, list) else None
    return elapsed, cpu, loss


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    from tracepp.runtime import cpu_binding, host_memory, launch

    rank = int(os.environ.get("RANK", "0"))
    options = launch.parse_args(list(rest))
    device_is_cpu = launch._planned_device().type == "cpu"
    if device_is_cpu:
        cpu_binding.bind(options.cpu_bind)  # before the process group starts gloo's threads, as run.py
    plans = [_build(os.path.abspath(folder), list(rest), rank, args.warmup + args.steps) for folder in args.folders]
    host_memory.configure(plans[0]["pipe"].device)
    lines = [[] for _ in plans]
    for cycle in range(args.warmup + args.steps):
        order = list(range(len(plans))) if cycle % 2 == 0 else list(range(len(plans)))[::-1]
        for k in order:
            elapsed, cpu, loss = _step(plans[k], cycle)
            if cycle >= args.warmup and plans[k]["reports"]:
                lines[k].append({"cycle": cycle, "step_time_s": elapsed, "cpu_time_s": cpu, "loss": loss})
    for k, plan in enumerate(plans):
        if plan["reports"]:
            with open(f"{args.metrics}.plan{k + 1}.jsonl", "w") as handle:
                handle.writelines(json.dumps(line) + "\n" for line in lines[k])
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
