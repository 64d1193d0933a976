"""One training step of a tracepp folder through ``tracepp_runtime.Pipeline`` under
``torch.autograd.graph.saved_tensors_hooks``: every rank's bytes of activations kept for backward over the step,
counted as the storage behind each saved tensor, each storage once (parameters, and the local shards of
DTensor parameters, left out). Run by ``benchmarks/tensor_parallel.py sequence``:

    torchrun --nproc-per-node N -m benchmarks.tp_activation_worker OUT --hidden D --vocab V --json result.json

Each saved storage is also put in a class by the last dim of the first saved tensor that uses it (the model's
widths, given by ``--hidden`` and ``--vocab``):

* ``between``: last dim ``D`` (the residual stream and the norms' inputs and outputs, the row-wise outputs, the
  inputs of column-wise linears) or 1 (the norms' per-token statistics): the values between the tensor-parallel
  regions;
* ``vocabulary``: last dim ``V`` or ``V / tp`` (the head's logits, the loss's log-softmax);
* ``inside``: any other floating tensor (attention heads and their rotary tables, the MLP's hidden features): the
  values inside the regions;
* ``integer``: token ids and targets.

Every saved tensor is held until the step ends, so no storage is freed and reused within it: a data pointer
names one storage. The figure is the total over the step (every microbatch), not a peak.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def _storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _class_of(tensor: torch.Tensor, hidden: int, vocab: int, tp: int) -> str:
    if not tensor.dtype.is_floating_point:
        return "integer"
    last = tensor.shape[-1] if tensor.dim() else 1
    if last in (hidden, 1):
        return "between"
    if last in (vocab, vocab // tp):
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

    pipe = tracepp_runtime.Pipeline(args.folder)
    tp = pipe.layout.tp
    params = set()
    for _name, param in pipe.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        params.add(local.untyped_storage().data_ptr())
    held, seen = [], {}
    by_class: dict = {}
    shapes: dict = {}

    def pack(tensor):
        held.append(tensor)  # alive to the step's end: its storage is not reused by a later allocation
        if tensor.device.type == "meta" or tensor.untyped_storage().data_ptr() in params:
            return tensor
        key = _storage_key(tensor)
        if key[0] == 0 or key in seen:
            return tensor
        kind = _class_of(tensor, args.hidden, args.vocab, tp)
        seen[key] = kind
        by_class[kind] = by_class.get(kind, 0) + key[1]
        label = f"{kind} {list(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
        count, total = shapes.get(label, (0, 0))
        shapes[label] = (count + 1, total + key[1])
        return tensor

    inputs, kwargs, target = pipe.user.batch(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        pipe.step(inputs, kwargs, target)
    held.clear()
    mine = {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "tp_index": getattr(pipe, "tp_index", 0),
            "saved_bytes": sum(by_class.values()), "saved_storages": len(seen), "by_class": by_class,
            "num_microbatches": pipe.manifest["plan"]["num_microbatches"],
            "by_shape": {label: {"storages": c, "bytes": b} for label, (c, b) in
                         sorted(shapes.items(), key=lambda item: -item[1][1])}}
    parts = [None] * pipe.world_size
    dist.all_gather_object(parts, mine)
    if pipe.rank == 0:
        with open(args.json, "w") as handle:
            json.dump(parts, handle, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
