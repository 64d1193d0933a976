"""One training step of a tracepp folder through ``tracepp_runtime.Pipeline``, measuring what context parallelism
changes on each rank: the bytes of activations kept for backward (``saved_tensors_hooks`` around the step, the
storage behind each saved tensor counted once, parameters left out (FSDP's gathered copies too), classed by the saved tensor's last dim as
``benchmarks/tp_activation_worker.py`` does), and the bytes the cp all-gathers received and the reduce-scatters
sent (the runtime's own counter, ``context_parallel.count_exchange``). Run by ``benchmarks/context_parallel.py
memory``::

    torchrun --nproc-per-node N -m benchmarks.cp_memory_worker OUT --hidden D --vocab V --json result.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def _class_of(tensor: torch.Tensor, hidden: int, vocab: int) -> str:
    if not tensor.dtype.is_floating_point:
        return "integer"
    last = tensor.shape[-1] if tensor.dim() else 1
    if last in (hidden, 1):
        return "between"
    if last == vocab:
        return "vocabulary"
    return "inside"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.folder))
    import tracepp_runtime
    from tracepp_runtime import context_parallel

    pipe = tracepp_runtime.Pipeline(args.folder)
    params = set()
    for _name, param in pipe.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        params.add(local.untyped_storage().data_ptr())
    held, seen, by_class = [], {}, {}

    def current_params() -> set:
        """The parameters as the stages read them now: FSDP swaps in the gathered (unsharded) copies during a
        stage's forward, whose storage is not the shard's."""
        return params | {p.untyped_storage().data_ptr() for stage in pipe.stages.values() for p in stage.parameters()
                         if not hasattr(p, "to_local")}

    def pack(tensor):
        held.append(tensor)  # alive to the step's end: its storage is not reused by a later allocation
        if tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() in current_params():
            return tensor
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] == 0 or key in seen:
            return tensor
        kind = _class_of(tensor, args.hidden, args.vocab)
        seen[key] = kind
        by_class[kind] = by_class.get(kind, 0) + key[1]
        return tensor

    inputs, kwargs, target = pipe.user.batch(0)
    context_parallel.count_exchange(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = pipe.step(inputs, kwargs, target)
    exchanged = context_parallel.exchanged()
    context_parallel.count_exchange(False)
    held.clear()
    mine = {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "cp_index": pipe.cp_index,
            "saved_bytes": sum(by_class.values()), "by_class": by_class, "exchanged": exchanged,
            "loss": float(loss) if loss is not None else None}
    parts = [None] * pipe.world_size
    dist.all_gather_object(parts, mine)
    if pipe.rank == 0:
        with open(args.json, "w") as handle:
            json.dump(parts, handle, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
