"""Tensor parallelism inside a stage: the four collectives the split inserts into the stage graphs, and the
cutting of this rank's parameter shards.

``tracepp split --tp T`` finds the column-then-row pairs in each stage graph (``split/tensor_parallel.py``)
and rewrites the graph with these ops, so the rank script reads as Megatron's recipe does:

* ``torch.ops.tracepp.tp_copy(x)``: identity forward, all-reduce of the gradient backward (Megatron's *f*),
  before the column-parallel matmuls that read a replicated ``x``;
* ``torch.ops.tracepp.tp_all_reduce(x)``: sum over the tp group forward, identity backward (*g*), after a
  row-parallel matmul (its bias is added after the sum);
* ``torch.ops.tracepp.tp_all_gather(x, dim)``: the shards joined along ``dim`` forward, this rank's slice of
  the gradient backward, where a sharded value meets an op that needs all of it (the head's logits);
* ``torch.ops.tracepp.tp_vocab_embedding(weight, ids, padding_idx)``: an embedding whose rows (the
  vocabulary) are split over the group: each rank looks up the ids it holds, zeros the rest, and the sum
  over the group is the full lookup.

Every rank of a tp group computes the same replicated values (the same inputs, the same ops), so gradients of
replicated parameters agree without communication. The group is set once by the runtime
(:func:`set_group`); with none (one process, ``tp`` 1) the ops are local identities. Imports torch only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_NAMESPACE = "tracepp"
_STATE = {"group": None, "size": 1, "rank": 0}


def set_group(group, size: int, rank: int) -> None:
    """The process group of this rank's tensor-parallel peers (the ``tp`` dim of the job's mesh)."""
    _STATE.update(group=group, size=size, rank=rank)


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    if _STATE["size"] > 1:
        dist.all_reduce(out, group=_STATE["group"])
    return out


def _gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    if _STATE["size"] == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(_STATE["size"])]
    dist.all_gather(parts, tensor.contiguous(), group=_STATE["group"])
    return torch.cat(parts, dim=dim)


def _register():
    if hasattr(getattr(torch.ops, _NAMESPACE), "tp_copy"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register.lib = lib  # keep the library alive for the life of the process
    lib.define("tp_copy(Tensor x) -> Tensor")
    lib.define("tp_all_reduce(Tensor x) -> Tensor")
    lib.define("tp_all_gather(Tensor x, int dim) -> Tensor")
    lib.define("tp_vocab_embedding(Tensor weight, Tensor indices, int padding_idx) -> Tensor")

    for name, forward in (("tp_copy", lambda x: x.clone()), ("tp_all_reduce", _all_reduce),
                          ("tp_all_gather", _gather)):
        lib.impl(name, forward, "CPU")
        lib.impl(name, forward, "CUDA")

    def gathered_shape(x, dim):
        shape = list(x.shape)
        shape[dim] = shape[dim] * _STATE["size"]
        return x.new_empty(shape)

    torch.library.register_fake(f"{_NAMESPACE}::tp_copy", lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::tp_all_reduce", lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::tp_all_gather", gathered_shape, lib=lib)

    def copy_backward(_ctx, grad):  # the opaque op, not its body: a compiled backward keeps the collective whole
        return torch.ops.tracepp.tp_all_reduce.default(grad)

    def reduce_backward(_ctx, grad):
        return grad

    def gather_setup(ctx, inputs, output):
        ctx.dim = inputs[1]

    def gather_backward(ctx, grad):
        return grad.chunk(_STATE["size"], dim=ctx.dim)[_STATE["rank"]].contiguous(), None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_copy", copy_backward, lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::tp_all_reduce", reduce_backward, lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::tp_all_gather", gather_backward, setup_context=gather_setup,
                                    lib=lib)

    def vocab_embedding(weight, indices, padding_idx):
        # a composite of differentiable ops: autograd and fake tensors go through it as through any torch code
        rows = weight.shape[0]
        first = _STATE["rank"] * rows
        outside = (indices < first) | (indices >= first + rows)
        local = (indices - first).masked_fill(outside, 0)
        local_padding = padding_idx - first if first <= padding_idx < first + rows else -1
        out = torch.ops.aten.embedding.default(weight, local, local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return torch.ops.tracepp.tp_all_reduce.default(out)

    lib.impl("tp_vocab_embedding", vocab_embedding, "CompositeImplicitAutograd")


_register()


# ---- this rank's shards

def shard(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``tensor`` split in ``size`` equal parts along ``dim``, in storage of
    its own (a view would keep the whole tensor alive)."""
    return tensor.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


def placement_of(manifest: dict, fqn: str):
    """The tensor-parallel shard dim of a parameter (0: column-wise or vocabulary, 1: row-wise), or None when
    it is replicated over the tp group."""
    entry = (manifest.get("tp") or {}).get("params", {}).get(fqn)
    return None if entry is None else entry.get("dim")


def piece_for(manifest: dict, size: int, rank: int):
    """``piece(fqn, tensor)`` for ``weights.load_rank_state``: a sharded parameter's piece for tp rank ``rank``,
    anything else whole. Every rank of a tp group reads the same whole tensors (the same checkpoint or the same
    seeded ``model()``), so the pieces fit together exactly."""
    def piece(fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        dim = placement_of(manifest, fqn)
        return tensor if dim is None else shard(tensor, dim, size, rank)
    return piece


def distribute(state: dict, manifest: dict, tp_mesh) -> dict:
    """FQN -> DTensor over the ``tp`` mesh of this rank's loaded state (already cut by :func:`piece_for`):
    sharded parameters ``Shard(dim)``, the other parameters ``Replicate()``; buffers stay plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for fqn, tensor in state.items():
        if not isinstance(tensor, torch.nn.Parameter):
            out[fqn] = tensor
            continue
        dim = placement_of(manifest, fqn)
        placement = Replicate() if dim is None else Shard(dim)  # pieces are equal: the global shape follows
        value = DTensor.from_local(tensor.detach(), tp_mesh, [placement], run_check=False)
        out[fqn] = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
    return out
