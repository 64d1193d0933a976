"""Context parallelism: one sample's sequence spread over the ``cp`` ranks of a stage, and the ops the split
inserts into the stage graphs (``split/context_parallel.py``) so that every rank computes exactly its part.

**The chunk order.** Each sequence of ``S`` positions is cut into ``2 * cp`` chunks of ``L = S / (2 * cp)``;
cp rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (Llama 3's order), so under causal attention every rank
has the same work: the early chunk attends to few keys, the late one to many. A dim of ``groups`` sequences side
by side (a ``[batch * seq]`` token dim) holds that pair of chunks of each sequence, in sequence order.

The ops (``torch.ops.tracepp.cp_*``), each with a fake implementation (shapes) and its autograd:

* ``cp_shard(x, dim, groups)``: this rank's positions of a whole value (token ids, a rotary table, the rows of a
  mask); backward puts the gradient back at those positions, zeros elsewhere (the gradient of a whole value is
  a part of the sum over the cp ranks);
* ``cp_positions(length, device)``: this rank's positions of a sequence of ``length``, as int64 (the query
  positions of a causal mask);
* ``cp_all_gather(x, dim, groups)``: the keys or values of every cp rank, joined in sequence order; backward
  reduce-scatters the gradient (each rank's queries contributed to every key's gradient);
* ``cp_reduce_scatter(x, dim, groups)``: the sum over the cp ranks of a whole value, this rank's positions
  only (the gradient of ``cp_all_gather``); backward all-gathers;
* ``cp_all_reduce(x)``: the sum over the cp ranks (a token sum, a token count); backward all-reduces too.

Every backward is the adjoint of its forward over the whole group, so the sum of the cp ranks' parameter
gradients is ``cp`` times the gradient of the loss every rank computes; the data-parallel engine averages them
over dp x cp (``mesh.build_cp_mesh``). With no group set (one process) the ops are local. Imports torch only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .process_state import shared

_NAMESPACE = "tracepp"
_STATE = shared("context_parallel", {"group": None, "size": 1, "rank": 0})  # one per process (process_state)


def set_group(group, size: int, rank: int) -> None:
    """The process group of this rank's context-parallel peers (the ``cp`` dim of the job's mesh)."""
    _STATE.update(group=group, size=size, rank=rank)


def count_exchange(on: bool = True) -> None:
    """Count the bytes this rank receives in the cp all-gathers and sends in the reduce-scatters from now on
    (a measurement's: ``benchmarks/context_parallel.py``); :func:`exchanged` reads them."""
    _STATE["counts"] = {"all_gather": 0, "reduce_scatter": 0, "all_gather_calls": 0, "reduce_scatter_calls": 0} \
        if on else None


def exchanged() -> dict:
    return dict(_STATE.get("counts") or {})


def _count(op: str, nbytes: int) -> None:
    counts = _STATE.get("counts")
    if counts is not None:
        counts[op] += nbytes
        counts[op + "_calls"] += 1


def size() -> int:
    return _STATE["size"]


def chunk_order(cp: int, rank: int) -> tuple:
    """The two chunks (of ``2 * cp``) cp rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def positions(length, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions (int64) of a sequence of ``length`` that cp rank ``rank`` of ``cp`` holds, in its order."""
    chunk = length // (2 * cp)
    first, second = chunk_order(cp, rank)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def check_length(length: int, cp: int, what: str) -> None:
    if length % (2 * cp):
        raise RuntimeError(f"{what}: a sequence of {length} positions does not cut into the 2 x cp = {2 * cp} equal "
                           f"chunks context parallelism spreads over its {cp} ranks: pad it to a multiple of "
                           f"{2 * cp}")


def _grouped(tensor: torch.Tensor, dim: int, groups: int, chunks: int) -> torch.Tensor:
    """``tensor`` with ``dim`` viewed as ``(groups, chunks, rest)``."""
    shape = list(tensor.shape)
    if shape[dim] % (groups * chunks):
        raise RuntimeError(f"a context-parallel dim of {shape[dim]} ({groups} sequence(s)) does not cut into "
                           f"{chunks} equal chunks: the sequence length must be a multiple of 2 x cp = "
                           f"{2 * _STATE['size']}")
    return tensor.reshape(shape[:dim] + [groups, chunks, shape[dim] // (groups * chunks)] + shape[dim + 1:])


def _shard(x: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """This rank's two chunks of each sequence in ``dim`` (differentiable ops only: autograd gives the backward,
    zeros at the other ranks' positions)."""
    cp, rank = _STATE["size"], _STATE["rank"]
    if cp == 1:
        return x.clone()
    first, second = chunk_order(cp, rank)
    view = _grouped(x, dim, groups, 2 * cp)
    out = torch.cat([view.narrow(dim + 1, first, 1), view.narrow(dim + 1, second, 1)], dim=dim + 1)
    shape = list(x.shape)
    shape[dim] = shape[dim] // cp
    return out.reshape(shape)


def _positions(length, device=None) -> torch.Tensor:
    return positions(length, _STATE["size"], _STATE["rank"], device)


def _gather(x: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """Every rank's chunks joined in sequence order: chunk c < cp is rank c's first, chunk c >= cp is rank
    (2 cp - 1 - c)'s second."""
    cp = _STATE["size"]
    if cp == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=_STATE["group"])
    _count("all_gather", (cp - 1) * x.numel() * x.element_size())  # received from the other ranks
    views = [_grouped(part, dim, groups, 2) for part in parts]
    ordered = [views[c].narrow(dim + 1, 0, 1) for c in range(cp)]
    ordered += [views[2 * cp - 1 - c].narrow(dim + 1, 1, 1) for c in range(cp, 2 * cp)]
    shape = list(x.shape)
    shape[dim] = shape[dim] * cp
    return torch.cat(ordered, dim=dim + 1).reshape(shape)


def _reduce_scatter(x: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """The sum over the group of a whole value, at this rank's positions only."""
    cp = _STATE["size"]
    if cp == 1:
        return x.clone()
    view = _grouped(x, dim, groups, 2 * cp)
    inputs = [torch.cat([view.narrow(dim + 1, a, 1), view.narrow(dim + 1, b, 1)], dim=dim + 1).contiguous()
              for a, b in (chunk_order(cp, r) for r in range(cp))]
    out = torch.empty_like(inputs[0])
    dist.reduce_scatter(out, inputs, group=_STATE["group"])
    _count("reduce_scatter", (cp - 1) * out.numel() * out.element_size())  # sent to the other ranks
    shape = list(x.shape)
    shape[dim] = shape[dim] // cp
    return out.reshape(shape)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    if _STATE["size"] > 1:
        dist.all_reduce(out, group=_STATE["group"])
    return out


def _register():
    if hasattr(getattr(torch.ops, _NAMESPACE), "cp_shard"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register.lib = lib  # keep the library alive for the life of the process
    lib.define("cp_shard(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("cp_positions(SymInt length, Device? device=None) -> Tensor")
    lib.define("cp_all_gather(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("cp_reduce_scatter(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("cp_all_reduce(Tensor x) -> Tensor")

    # composites of differentiable ops: autograd, fake tensors and the compiler go through them as through any
    # torch code (the rank and size are read when the op runs)
    lib.impl("cp_shard", _shard, "CompositeImplicitAutograd")
    lib.impl("cp_positions", _positions, "CompositeImplicitAutograd")
    for name, forward in (("cp_all_gather", _gather), ("cp_reduce_scatter", _reduce_scatter),
                          ("cp_all_reduce", _all_reduce)):
        lib.impl(name, forward, "CPU")
        lib.impl(name, forward, "CUDA")

    def resized(factor):
        def fake(x, dim, groups=1):
            shape = list(x.shape)
            shape[dim] = shape[dim] * _STATE["size"] if factor > 0 else shape[dim] // _STATE["size"]
            return x.new_empty(shape)
        return fake

    torch.library.register_fake(f"{_NAMESPACE}::cp_all_gather", resized(1), lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::cp_reduce_scatter", resized(-1), lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::cp_all_reduce", lambda x: torch.empty_like(x), lib=lib)

    def keep_dims(ctx, inputs, output):
        ctx.dim, ctx.groups = inputs[1], inputs[2] if len(inputs) > 2 else 1

    def gather_backward(ctx, grad):  # each rank's queries contributed to every key: the sum, at its positions
        return torch.ops.tracepp.cp_reduce_scatter.default(grad, ctx.dim, ctx.groups), None, None

    def scatter_backward(ctx, grad):
        return torch.ops.tracepp.cp_all_gather.default(grad, ctx.dim, ctx.groups), None, None

    def reduce_backward(_ctx, grad):  # every rank's copy of the sum reached its loss: their gradients add up
        return torch.ops.tracepp.cp_all_reduce.default(grad)

    torch.library.register_autograd(f"{_NAMESPACE}::cp_all_gather", gather_backward, setup_context=keep_dims,
                                    lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::cp_reduce_scatter", scatter_backward, setup_context=keep_dims,
                                    lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::cp_all_reduce", reduce_backward, lib=lib)


_register()
