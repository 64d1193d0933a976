"""Train the benchmark's Hugging Face Llama with torch's own tensor parallelism (the peer of tracepp's ``--tp``).

    torchrun --nproc-per-node TP*PP -m benchmarks.tp_torch_worker --model-file benchmarks/hf_llama_model.py \\
        --tp 2 [--pp 2 --microbatches 4] [--sequence-parallel] --steps 12 --metrics m.jsonl [--save final.pt]

The plan a torchtitan user writes for Llama (torchtitan's ``apply_tp`` for its Llama, with Hugging Face's module
names), applied with ``parallelize_module`` over the ``tp`` dim of ``init_device_mesh("cpu", (pp, tp), ("pp",
"tp"))`` on gloo:

* ``model.embed_tokens``: ``RowwiseParallel(input_layouts=Replicate())`` (the vocabulary split over tp, each rank
  looks up the ids it holds; the output all-reduced, or reduce-scattered over the sequence with SP);
* per layer ``self_attn.{q,k,v}_proj``, ``mlp.{gate,up}_proj``: ``ColwiseParallel()``; ``self_attn.o_proj``,
  ``mlp.down_proj``: ``RowwiseParallel()``;
* ``lm_head``: ``ColwiseParallel(output_layouts=Replicate())``: the logits gathered, the loss on whole logits (as
  tracepp computes it; torchtitan's ``loss_parallel`` is not used);
* ``--sequence-parallel``: ``SequenceParallel()`` on ``input_layernorm``, ``post_attention_layernorm`` and
  ``model.norm``; ``PrepareModuleInput`` gathering the sequence before ``self_attn`` and ``mlp``; the row-wise
  outputs ``Shard(1)`` (reduce-scatter); the embedding's output ``Shard(1)``; the head's input ``Shard(1)``. The
  residual stream stays a ``DTensor`` sharded on the sequence (``use_local_output=False``): Hugging Face's
  ``LlamaModel`` reads the sequence length from the embedding's output (positions, the causal mask), so it must
  see the global shape there, and a residual add of a ``DTensor`` and a plain tensor is refused.

``--pp 1`` (default): the whole model on every tp rank, one forward and backward of the full batch per step.
``--pp 2``: torchtitan's pipeline recipe around it: each pipeline rank builds its stage by hand (:class:`Stage`:
the embedding and the first half of the layers, or the second half, the norm and the head), applies the same tp
plan, and runs ``PipelineStage`` on the ``pp`` group with ``Schedule1F1B`` (``--microbatches``, mean
cross-entropy per microbatch, ``scale_grads=True``); with SP the boundary carries the local sequence shard.

SGD (the model file's ``optimizer``) over the rank's parameters (DTensors). The step time is what tracepp's runtime
times: on the last stage's tp rank 0, wall and process CPU time of forward, backward (the schedule's step),
``optimizer.step`` and ``zero_grad``; the batch is built before the clock starts. One JSON line per step:
``step``, ``loss``, ``step_time_s``, ``cpu_time_s``. ``--save PATH``: after the last step, the full parameters
(``full_tensor()``) keyed by the model's FQNs, written by global rank 0.
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
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--microbatches", type=int, default=1, help="--pp 2: microbatches per step (1F1B)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--save", default=None)
    parser.add_argument("--memory-dir", default=None,
                        help="peak memory of the last of the run's steps (benchmarks/memory.py; the last two steps are "
                             "the memory window: leave them out of the timing)")
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def tp_plan(model: torch.nn.Module, layers, sequence_parallel: bool, has_embed: bool, has_head: bool) -> dict:
    """{module FQN: ParallelStyle}: torchtitan's Llama plan under Hugging Face's names (see the docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    sp = sequence_parallel
    plan = {}
    if has_embed:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Shard(1) if sp else Replicate(),
                                                     use_local_output=not sp)
    if has_head:
        if sp:
            plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    for index in layers:
        prefix = f"model.layers.{index}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = (RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp
                                        else RowwiseParallel())
        if sp:
            plan[f"{prefix}.input_layernorm"] = SequenceParallel()
            plan[f"{prefix}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{prefix}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True)
            plan[f"{prefix}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                       use_local_output=True)
    return plan


class Stage(torch.nn.Module):
    """One pipeline stage of Hugging Face's ``LlamaForCausalLM`` built by hand, as torchtitan builds its stages:
    this stage's modules under their original FQNs (``model.layers.2.mlp.up_proj``), the others dropped. The
    forward is ``LlamaModel.forward``'s, less what other stages hold; the causal mask is SDPA's ``is_causal``
    (Hugging Face passes no mask to SDPA when there is no padding)."""

    def __init__(self, full: torch.nn.Module, first: bool, last: bool, layers: list):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = full.model.embed_tokens if first else None
        self.model.rotary_emb = full.model.rotary_emb
        self.model.layers = torch.nn.ModuleDict({str(k): full.model.layers[k] for k in layers})
        self.model.norm = full.model.norm if last else None
        self.lm_head = full.lm_head if last else None
        self.tp_mesh = None  # --sequence-parallel: the boundary carries the local sequence shard
        self.sequence_parallel = False

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Shard

        if self.model.embed_tokens is not None:
            x = self.model.embed_tokens(x)
        elif self.sequence_parallel:
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(x, position_ids=positions)
        for layer in self.model.layers.values():
            x = layer(x, attention_mask=None, position_embeddings=position_embeddings, position_ids=positions)
        if self.lm_head is None:
            return x.to_local() if isinstance(x, DTensor) else x
        return self.lm_head(self.model.norm(x))


def _logits_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The model file's loss (mean cross-entropy) on the last stage's logits (a stage returns no model output)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main(argv=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != args.tp * args.pp:
        raise SystemExit(f"world size {world} != --tp {args.tp} x --pp {args.pp}")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (args.pp, args.tp), mesh_dim_names=("pp", "tp"))
    tp_mesh, pp_rank, tp_index = mesh["tp"], mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    user = load_model_file(args.model_file)
    model = user.model()
    model.train()
    layers = len(model.model.layers)
    if args.pp == 1:
        module = model
        parallelize_module(module, tp_mesh, tp_plan(module, range(layers), args.sequence_parallel, True, True))
        schedule = None
    else:
        from torch.distributed import pipelining as pp

        half = layers // 2
        first, last = pp_rank == 0, pp_rank == 1
        mine = list(range(half)) if first else list(range(half, layers))
        module = Stage(model, first, last, mine)
        module.tp_mesh, module.sequence_parallel = tp_mesh, args.sequence_parallel
        del model
        parallelize_module(module, tp_mesh, tp_plan(module, mine, args.sequence_parallel, first, last))
        stage = pp.PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = pp.Schedule1F1B(stage, args.microbatches, loss_fn=_logits_loss, scale_grads=True)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = user.optimizer(params)
    reports = tp_index == 0 and pp_rank == args.pp - 1
    memory = PeakMemory(torch.device("cpu")) if args.memory_dir else None
    for step in range(args.steps):
        inputs, kwargs, target = user.batch(step)
        if memory is not None:
            memory.at_step(step, args.steps)
        start, cpu_start = time.perf_counter(), time.process_time()
        if schedule is None:
            loss = user.loss_fn(module(*inputs, **kwargs), target)  # the output goes with the graph (as tracepp's)
            loss.backward()
            loss = loss.detach()
        else:
            losses = [] if pp_rank == 1 else None
            schedule.step(*(inputs if pp_rank == 0 else ()), target=target if pp_rank == 1 else None, losses=losses,
                          return_outputs=False)
            loss = torch.stack([l.detach() for l in losses]).mean() if losses is not None else None
            del losses
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed, cpu_time = time.perf_counter() - start, time.process_time() - cpu_start
        if reports:
            with open(args.metrics, "a") as handle:
                handle.write(json.dumps({"step": step, "loss": float(loss), "step_time_s": elapsed,
                                         "cpu_time_s": cpu_time}) + "\n")
    if memory is not None:
        write_memory(args.memory_dir, rank, memory.stop())
    if args.save:
        full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in module.named_parameters()}  # a collective over tp on every rank
        parts = [None] * world if rank == 0 else None
        dist.gather_object(full if tp_index == 0 else {}, parts, dst=0)
        if rank == 0:
            state = {}
            for part in parts:
                state.update(part)
            torch.save(state, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
