"""One AdamW step of a tracepp folder through ``tracepp_runtime.Pipeline``, then every rank's bytes of the routed
expert weights, their gradients and AdamW state, and of the other parameters, as they sit in memory (each
tensor's local shard once; ``storage_bytes_all`` sums the distinct storages behind them all, which FSDP's flat
gradient buffer shares); and, during the step, the most expert weight and gradient bytes the rank's stage modules
held after any action (FSDP keeps its parameters gathered from a stage's first forward to its last backward, and
their gradients whole until then), with the worst moment's total: those, plus the shards and the optimizer state
kept beside them (the state as it is after the step, as in every later step). Run by
``benchmarks/expert_parallel.py memory``:

    torchrun --nproc-per-node N -m benchmarks.ep_memory_worker OUT --experts-from EP_OUT --json result.json

``--experts-from`` names a folder split with ``--ep`` > 1, whose manifest says which parameters are routed
expert weights, so an ep = 1 run is counted by the same categories.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(tensor, seen: set) -> int:
    """The bytes of a tensor's local shard, each tensor once per ``seen``. A tensor's own bytes, not its
    storage's: FSDP2 reduce-scatters every gradient of a stage into one flat buffer, whose storage would otherwise
    be charged to whichever parameter came first (``_storages`` checks that nothing hides behind the views)."""
    local = _local(tensor)
    key = (local.data_ptr(), local.numel())
    if key in seen or local.numel() == 0:
        return 0
    seen.add(key)
    return local.numel() * local.element_size()


def _storages(tensors) -> tuple:
    """(bytes of the distinct storages behind ``tensors``, their data pointers)."""
    found = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return sum(found.values()), set(found)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--experts-from", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.folder))
    import tracepp_runtime

    with open(os.path.join(args.experts_from, "manifest.json")) as handle:
        experts = set(json.load(handle)["ep"]["params"])
    pipe = tracepp_runtime.Pipeline(args.folder)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    in_step = {"param_bytes": 0, "grad_bytes": 0, "after": None, "storages": set()}

    def measure(label, run):  # after each action: what the stage modules hold of the experts right now
        result = run()
        seen: set = set()
        params = [p for stage in pipe.stages.values() for name, p in stage.named_parameters() if name in experts]
        grads = [p.grad for p in params if p.grad is not None]
        param_bytes = sum(_bytes(p, seen) for p in params)
        grad_bytes = sum(_bytes(g, seen) for g in grads)
        if param_bytes + grad_bytes > in_step["param_bytes"] + in_step["grad_bytes"]:
            in_step.update(param_bytes=param_bytes, grad_bytes=grad_bytes, after=str(label),
                           storages=_storages(params + grads)[1])
        return result

    pipe.set_action_hook(measure)
    inputs, kwargs, target = pipe.user.batch(0)
    pipe.step(inputs, kwargs, target)
    pipe.set_action_hook(None)
    pipe.sync_shared_grads()
    optimizer.step()
    layout = pipe.layout
    mine = {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "dp_index": pipe.dp_index,
            "ep_index": pipe.ep_index if layout.ep > 1 else None, "stages": sorted(pipe.stages),
            "in_step_expert_param_bytes": in_step["param_bytes"], "in_step_expert_grad_bytes": in_step["grad_bytes"],
            "in_step_max_after": in_step["after"]}
    seen: set = set()
    every = []
    for kind in ("expert", "other"):
        params = [(name, p) for name, p in pipe.named_parameters() if (name in experts) == (kind == "expert")]
        state = [v for _, p in params for v in optimizer.state[p].values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        grads = [p.grad for _, p in params if p.grad is not None]
        mine[f"{kind}_param_bytes"] = sum(_bytes(p, seen) for _, p in params)
        mine[f"{kind}_grad_bytes"] = sum(_bytes(g, seen) for g in grads)
        mine[f"{kind}_optimizer_bytes"] = sum(_bytes(v, seen) for v in state)
        every += [p for _, p in params] + grads + state
        if kind == "expert":
            mine["expert_local_shapes"] = {name: list(_local(p).shape) for name, p in params}
            # the worst moment of a step: what the modules held then, plus the shards and state kept beside it
            # (FSDP's own shards while its gathered copies are in use; with ep the same tensors: counted once)
            beside = [p for _, p in params if _local(p).untyped_storage().data_ptr() not in in_step["storages"]]
            mine["worst_moment_expert_bytes"] = (in_step["param_bytes"] + in_step["grad_bytes"]
                                                 + sum(_bytes(p, set()) for p in beside)
                                                 + mine["expert_optimizer_bytes"])
    storage_bytes, _ = _storages(every)
    mine["storage_bytes_all"] = storage_bytes  # the distinct storages behind everything counted above
    mine["counted_bytes_all"] = sum(v for k, v in mine.items() if k.endswith(("_param_bytes", "_grad_bytes",
                                                                             "_optimizer_bytes"))
                                    and not k.startswith("in_step"))
    parts = [None] * pipe.world_size
    dist.all_gather_object(parts, mine)
    if pipe.rank == 0:
        with open(args.json, "w") as handle:
            json.dump(parts, handle, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
