"""One training step of a tracepp folder through ``tracepp_runtime.Pipeline``, then every rank's bytes of
parameters, gradients and AdamW state as they sit in memory (the storage behind a DTensor's local shard, each
storage once),
split into the parameters a tensor-parallel plan shards and the rest. Run by ``benchmarks/tensor_parallel.py``:

    torchrun --nproc-per-node N -m benchmarks.tp_memory_worker OUT --plan-from TP_OUT --json result.json

``--plan-from`` names the folder whose manifest says which parameters are sharded (the tp > 1 split), so a
tp = 1 run is counted by the same categories.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


_SEEN: set = set()


def _bytes(tensor) -> int:
    """The bytes of the storage behind a tensor (a DTensor's local shard), each storage counted once: a shard
    that is a view of the whole tensor counts as the whole."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    storage = local.untyped_storage()
    if storage.data_ptr() in _SEEN:
        return 0
    _SEEN.add(storage.data_ptr())
    return storage.nbytes()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--plan-from", required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.folder))
    import tracepp_runtime

    with open(os.path.join(args.plan_from, "manifest.json")) as handle:
        sharded = {fqn for fqn, e in json.load(handle)["tp"]["params"].items() if e["dim"] is not None}
    pipe = tracepp_runtime.Pipeline(args.folder)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    inputs, kwargs, target = pipe.user.batch(0)
    pipe.step(inputs, kwargs, target)
    pipe.sync_shared_grads()
    optimizer.step()
    mine = {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "tp_index": getattr(pipe, "tp_index", 0)}
    for kind in ("sharded", "other"):
        params = [p for name, p in pipe.named_parameters() if (name in sharded) == (kind == "sharded")]
        mine[f"{kind}_param_bytes"] = sum(_bytes(p) for p in params)
        mine[f"{kind}_grad_bytes"] = sum(_bytes(p.grad) for p in params if p.grad is not None)
        mine[f"{kind}_optimizer_bytes"] = sum(_bytes(v) for p in params for v in optimizer.state[p].values()
                                              if isinstance(v, torch.Tensor) and v.dim() > 0)
    parts = [None] * pipe.world_size
    dist.all_gather_object(parts, mine)
    if pipe.rank == 0:
        with open(args.json, "w") as handle:
            json.dump(parts, handle, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
