"""Train the benchmark's Mixtral data parallel with its experts over an ep group, as torchtitan does (the peer of
tracepp's ``--dp N --ep N``).

    torchrun --nproc-per-node 2 -m benchmarks.ep_torch_worker --model-file benchmarks/mixtral_model.py \\
        --steps 12 --metrics m.jsonl [--dispatcher torchtitan|rewrite] [--save final.pt]

* ``init_device_mesh("cpu", (world,), ("dp",))`` on gloo; expert parallelism over the same ranks (ep = dp, the
  experts split, nothing replicated: torchtitan's ``dp_shard = ep``, its expert-FSDP dim of size 1);
* each decoder layer's ``mlp.experts`` replaced by ``benchmarks/ep_alltoall_moe.RoutedExperts``: this rank's experts
  (rows ``[r E / ep, (r + 1) E / ep)`` of the weights), tokens moved by torchtitan's all-to-all token dispatcher
  (``--dispatcher torchtitan``: its own class, from an installed torchtitan; ``rewrite``: the same steps in
  ``benchmarks/ep_alltoall_moe.py``; ``auto`` (default): torchtitan's where it imports), grouped matmuls between
  (``--grouped-mm torch``: ``torch._grouped_mm``, as torchtitan; ``fallback``: transformers' per-expert loop);
* ``fully_shard`` of the model over dp with the expert weights as ``ignored_params`` (one FSDP unit, as tracepp's
  one unit per stage; ``reshard_after_forward=False``); FSDP averages the dense gradients over dp; each expert's
  gradient (the sum over the ranks whose tokens it took) is divided by dp before the optimizer step (what
  torchtitan's expert FSDP does with its gradient divide factor);
* each rank trains on its contiguous ``rank``-th slice of the global batch ``batch(step)`` (as tracepp's replicas);
  the model file's loss (mean cross-entropy) and its optimizer, default SGD.

Timing as tracepp's runtime: on rank 0, wall and process CPU time of forward, backward, the expert gradients'
division, ``optimizer.step`` and ``zero_grad``, and the global batch's loss (one all-reduce of the replicas'
losses, as tracepp prints it). One JSON line per step. ``--save PATH``: the full parameters under the model's
FQNs, written by rank 0.
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", required=True)
    parser.add_argument("--dispatcher", default="auto", choices=["auto", "torchtitan", "rewrite"])
    parser.add_argument("--grouped-mm", default="torch", choices=["torch", "fallback"],
                        help="torch: torch._grouped_mm (torchtitan's, and eager Hugging Face's on CPU); fallback: "
                             "transformers' per-expert loop (what a traced Mixtral calls)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--save", default=None)
    parser.add_argument("--memory-dir", default=None,
                        help="peak memory of the run's last step (benchmarks/memory.py; its last two steps are the "
                             "memory window: leave them out of the timing)")
    parser.add_argument("--lr", type=float, default=0.01, help="SGD's learning rate where the model file has no optimizer")
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def make_dispatcher(kind: str, num_experts: int, top_k: int, ep_mesh):
    from benchmarks.ep_alltoall_moe import AllToAllDispatcher, torchtitan_dispatcher

    if kind in ("auto", "torchtitan"):
        try:
            return torchtitan_dispatcher(num_experts, top_k, ep_mesh), "torchtitan"
        except ImportError as error:
            if kind == "torchtitan":
                raise SystemExit(f"--dispatcher torchtitan: torchtitan does not import here ({error}); pip install "
                                 f"torchtitan (it imports triton too), or use --dispatcher rewrite")
    return AllToAllDispatcher(num_experts, top_k, ep_mesh), "rewrite"


def main(argv=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.ep_alltoall_moe import RoutedExperts

    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    user = load_model_file(args.model_file)
    model = user.model()
    model.train()
    config = model.config
    experts_params, names, kind = [], {}, None
    for index, layer in enumerate(model.model.layers):
        dispatcher, kind = make_dispatcher(args.dispatcher, config.num_local_experts, config.num_experts_per_tok,
                                           mesh["dp"])
        routed = RoutedExperts(layer.mlp.experts, rank, world, dispatcher, config.num_experts_per_tok,
                               args.grouped_mm)
        layer.mlp.experts = routed
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(routed, name)
            experts_params.append(param)
            names[param] = f"model.layers.{index}.mlp.experts.{name}"
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False, ignored_params=set(experts_params))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = user.optimizer(params) if hasattr(user, "optimizer") else torch.optim.SGD(params, lr=args.lr)
    if rank == 0:
        print(f"dispatcher: {kind}", flush=True)
    memory = PeakMemory(torch.device("cpu")) if args.memory_dir else None
    for step in range(args.steps):
        inputs, kwargs, target = user.batch(step)
        per = target.shape[0] // world
        inputs = tuple(t[rank * per:(rank + 1) * per] for t in inputs)
        target = target[rank * per:(rank + 1) * per]
        if memory is not None:
            memory.at_step(step, args.steps)
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = user.loss_fn(model(*inputs, **kwargs), target)  # the output goes with the graph (as tracepp's)
        loss.backward()
        torch._foreach_div_([p.grad for p in experts_params if p.grad is not None], float(world))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach() / world
        dist.all_reduce(total)
        elapsed, cpu_time = time.perf_counter() - start, time.process_time() - cpu_start
        if rank == 0:
            with open(args.metrics, "a") as handle:
                handle.write(json.dumps({"step": step, "loss": float(total), "step_time_s": elapsed,
                                         "cpu_time_s": cpu_time, "dispatcher": kind}) + "\n")
    if memory is not None:
        write_memory(args.memory_dir, rank, memory.stop())
    if args.save:
        full = {}
        for name, param in model.named_parameters():
            if param in names:
                parts = [torch.empty_like(param.detach()) for _ in range(world)]
                dist.all_gather(parts, param.detach().contiguous())
                full[names[param]] = torch.cat(parts, dim=0)
            else:
                full[name] = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
        if rank == 0:
            torch.save(full, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
