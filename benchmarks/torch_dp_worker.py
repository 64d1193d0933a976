"""Train a benchmark model data parallel x pipeline parallel with torch's own pieces (the DP x PP baseline).

    torchrun --nproc-per-node DP*PP -m benchmarks.torch_dp_worker --model-file m.py --dp 2 --schedule 1f1b \\
        --microbatches 4 --steps 12 --metrics m.jsonl [--memory-dir DIR] [--save final.pt] [--split tracer|manual] \\
        [--fsdp-units stage|block] [--dp-mode fsdp|ddp]

What tracepp's ``--dp N --dp-mode fsdp`` is compared against, built by hand the way torchtitan builds PP+FSDP:

* a 2-D ``init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))`` on gloo (global rank =
  dp_index * pp + pp_rank, the layout of tracepp's default ``--dp-order pp-inner``);
* the split at the model file's ``split_points`` (the block FQNs tracepp splits at); pipeline rank ``pp_rank``
  takes stage ``pp_rank`` (one stage per rank: GPipe and 1F1B). ``--split tracer`` (default):
  ``torch.distributed.pipelining.pipeline`` with ``SplitPoint.BEGINNING``, traced on one microbatch of a
  replica's slice, and ``build_stage``; its stage modules run the traced graph through ``torch.fx``'s
  interpreter (``torch.export.unflatten``), node by node in Python. ``--split manual``: torchtitan's way, the
  stage built by hand as an eager ``nn.Module`` holding only its own modules (:class:`ManualStage`, which knows
  ``benchmarks/gpt_model.py``'s GPT) and ``PipelineStage`` (shapes inferred at the first step). Both keep the
  model's FQNs, so the FSDP wrapping below is the same;
* ``fully_shard`` over ``mesh["dp"]`` with ``reshard_after_forward=False`` (torchtitan's default when PP is
  on: no per-microbatch all-gather). ``--fsdp-units stage`` (default): the stage module is one FSDP unit, as in
  tracepp; ``block``: torchtitan's layout, one unit per transformer block, one for the embeddings (first
  stage), one for ``ln_f`` + ``head`` (last stage), and the stage module as the root unit;
* the stage on the pp group (``group=mesh["pp"].get_group()``) and the matching ``Schedule*`` with ``scale_grads=True``
  and the mean cross-entropy per microbatch; torch's schedule defers FSDP's gradient reduction to one
  reduce-scatter per stage after the step's last backward (``perform_reduce_grad``), and FSDP averages over dp,
  so the gradient is the global batch's mean, as in tracepp;
* ``--dp-mode ddp``: ``replicate`` (DDP semantics on FSDP2's machinery) of the stage instead, as tracepp's
  ``--dp-mode ddp``;
* SGD (``--lr``, as tracepp's default optimizer) over the rank's sharded parameters; each replica trains on
  its contiguous ``dp_index``-th slice of the global batch ``batch(step)``;
* ``--precision bf16``: ``fully_shard``/``replicate`` with torchtitan's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` (what tracepp's ``--precision bf16`` applies) and the loss computed on the fp32-cast
  output, as tracepp and torchtitan compute it.

Timing, as tracepp's runtime times its ``--metrics`` step: on the last stage's rank of replica 0, wall time of
``schedule.step``, the global batch's loss (mean of the replicas' losses, one all-reduce over dp, as tracepp
prints), ``optimizer.step`` and ``zero_grad``. One JSON line per step: ``step``, ``loss``, ``step_time_s``.
``--save PATH``: after the last step, the full parameters (``full_tensor()``) keyed by the model's FQNs, one
file written by global rank 0 (to check the run against tracepp's ``--save``).
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
from benchmarks.memory import PeakMemory, write_memory

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", required=True)
    parser.add_argument("--dp", type=int, required=True, help="data-parallel replicas (world = dp x stages)")
    parser.add_argument("--schedule", required=True, choices=sorted(SCHEDULES))
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per replica")
    parser.add_argument("--dp-mode", default="fsdp", choices=["fsdp", "ddp"],
                        help="fsdp: fully_shard; ddp: replicate (DDP semantics on FSDP2's machinery, as tracepp)")
    parser.add_argument("--split", default="tracer", choices=["tracer", "manual"],
                        help="tracer: pipeline() + SplitPoint.BEGINNING; manual: torchtitan's hand-built stages")
    parser.add_argument("--fsdp-units", default="stage", choices=["stage", "block"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), loss on fp32 outputs")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--memory-dir", default=None)
    parser.add_argument("--cpu-from-step", type=int, default=None,
                        help="also record CPU time per step from this step to the memory window (memory.py)")
    parser.add_argument("--save", default=None)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for every collective and P2P op")
    return parser.parse_args(argv)


def replica_slice(tensor: torch.Tensor, dp: int, dp_index: int) -> torch.Tensor:
    if tensor.shape[0] % dp:
        raise SystemExit(f"--dp {dp} does not divide the global batch of {tensor.shape[0]} samples")
    per = tensor.shape[0] // dp
    return tensor[dp_index * per:(dp_index + 1) * per]


class ManualStage(torch.nn.Module):
    """One pipeline stage of ``benchmarks/gpt_model.py``'s GPT built by hand, as torchtitan's ``_split_module``
    does (keep this stage's modules, drop the others; the forward tolerates the missing ones): the embeddings
    on the first stage, ``ln_f`` + ``head`` on the last, the blocks between the split points in a ``ModuleDict``
    keyed by their original index, so every parameter keeps the model's FQN (``blocks.4.attn.qkv.weight``)."""

    def __init__(self, model: torch.nn.Module, split_points: list, stage_index: int):
        super().__init__()
        bounds = [0] + [int(fqn.split(".")[1]) for fqn in split_points] + [len(model.blocks)]
        first, last = stage_index == 0, stage_index == len(bounds) - 2
        self.tok = model.tok if first else None
        self.pos = model.pos if first else None
        self.blocks = torch.nn.ModuleDict({str(k): model.blocks[k]
                                           for k in range(bounds[stage_index], bounds[stage_index + 1])})
        self.ln_f = model.ln_f if last else None
        self.head = model.head if last else None

    def forward(self, x):
        if self.tok is not None:  # the model's own forward, less what other stages hold
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.head is not None else x


def shard_stage(stage_module: torch.nn.Module, dp_mesh, units: str, mode: str = "fsdp", precision: str = "fp32") -> None:
    """fully_shard over dp, reshard_after_forward=False (PP): the stage as one unit, or torchtitan's per block;
    ``mode="ddp"``: ``replicate`` of the stage (one unit). ``precision="bf16"``: torchtitan's mixed precision
    policy on every unit."""
    from functools import partial

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bf16":
        fully_shard = partial(fully_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                          reduce_dtype=torch.float32))
    if mode == "ddp":
        if units != "stage":
            raise SystemExit("--dp-mode ddp wraps the stage as one unit: use --fsdp-units stage")
        from torch.distributed._composable.replicate_with_fsdp import replicate
        policy = {} if precision == "fp32" else {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                                    reduce_dtype=torch.float32)}
        replicate(stage_module, mesh=dp_mesh, **policy)
        return

    if units == "block":
        children = dict(stage_module.named_children())
        for block in children["blocks"].children() if "blocks" in children else ():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        embeddings = [children[name] for name in ("tok", "pos") if name in children]
        if embeddings:
            fully_shard(embeddings, mesh=dp_mesh, reshard_after_forward=False)
        head = [children[name] for name in ("ln_f", "head") if name in children]
        if head:
            fully_shard(head, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(stage_module, mesh=dp_mesh, reshard_after_forward=False)


def main(argv=None) -> None:
    from torch.distributed import pipelining as pp
    from torch.distributed.device_mesh import init_device_mesh

    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % args.dp:
        raise SystemExit(f"world size {world} is not a multiple of --dp {args.dp}")
    num_stages = world // args.dp
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (args.dp, num_stages), mesh_dim_names=("dp", "pp"))
    dp_index, pp_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    device = torch.device("cpu")
    user = load_model_file(args.model_file)
    split_points = list(user.split_points)
    if len(split_points) != num_stages - 1:
        raise SystemExit(f"the model file has {len(split_points) + 1} stages; {world} processes with --dp "
                         f"{args.dp} need {num_stages}")
    model = user.model()
    if args.split == "manual":  # torchtitan's way: the stage is an eager nn.Module holding this stage's modules
        stage_module = ManualStage(model, split_points, pp_rank)
        del model
        shard_stage(stage_module, mesh["dp"], args.fsdp_units, args.dp_mode, args.precision)
        stage = pp.PipelineStage(stage_module, pp_rank, num_stages, device, group=mesh["pp"].get_group())
    else:
        inputs, kwargs, target = user.batch(0)
        mb_args = tuple(replica_slice(t, args.dp, dp_index).tensor_split(args.microbatches)[0] for t in inputs)
        pipe = pp.pipeline(model, mb_args=mb_args, mb_kwargs=kwargs or None,
                           split_spec={fqn: pp.SplitPoint.BEGINNING for fqn in split_points})
        if pipe.num_stages != num_stages:
            raise SystemExit(f"torch split the model into {pipe.num_stages} stages, expected {num_stages}")
        stage_module = pipe.get_stage_module(pp_rank)
        shard_stage(stage_module, mesh["dp"], args.fsdp_units, args.dp_mode, args.precision)
        stage = pp.build_stage(stage_module, pp_rank, pipe.info(), device, group=mesh["pp"].get_group())
        del model, pipe
    loss_fn = user.loss_fn if args.precision == "fp32" else (lambda output, target: user.loss_fn(output.float(), target))
    schedule = getattr(pp, SCHEDULES[args.schedule])(stage, args.microbatches, loss_fn=loss_fn, scale_grads=True)
    optimizer = torch.optim.SGD([p for p in stage_module.parameters() if p.requires_grad], lr=args.lr)
    has_first, has_last = pp_rank == 0, pp_rank == num_stages - 1
    reports = has_last and dp_index == 0
    dp_group = mesh["dp"].get_group()
    memory = PeakMemory(device, cpu_from_step=args.cpu_from_step) if args.memory_dir else None  # the last MEMORY_STEPS steps: untimed by the harness
    for step in range(args.steps):
        inputs, kwargs, target = user.batch(step)
        inputs = tuple(replica_slice(t, args.dp, dp_index) for t in inputs)
        target = replica_slice(target, args.dp, dp_index)
        losses = [] if has_last else None
        if memory is not None:
            memory.at_step(step, args.steps)
        start = time.perf_counter()
        schedule.step(*(inputs if has_first else ()), target=target if has_last else None, losses=losses,
                      return_outputs=False, **(dict(kwargs) if has_first else {}))
        loss = None
        if has_last:  # the global batch's loss, as tracepp reports it: the replicas' mean
            loss = torch.stack([l.detach().float() for l in losses]).mean() / args.dp
            dist.all_reduce(loss, group=dp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        if reports:
            with open(args.metrics, "a") as handle:
                handle.write(json.dumps({"step": step, "loss": float(loss), "step_time_s": elapsed}) + "\n")
    if memory is not None:
        write_memory(args.memory_dir, rank, memory.stop())
    if args.save:
        full = {name: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                for name, p in stage_module.named_parameters()}  # a collective over dp on every rank
        parts = [None] * world if rank == 0 else None
        dist.gather_object(full if dp_index == 0 else {}, parts, dst=0)
        if rank == 0:
            state = {}
            for part in parts:
                state.update(part)
            torch.save(state, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
