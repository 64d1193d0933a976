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
* ``cp_all_gather(x, dim, groups, repeats, head_dim)``: the keys or values of every cp rank, joined in sequence
  order, their heads repeated after the exchange for grouped-query attention; backward sums the repeated heads and
  reduce-scatters the gradient (each rank's queries contributed to every key's gradient). What attention keeps
  of it for backward is this rank's shard (:func:`kv_shards_kept_for_backward`), gathered again in backward;
* ``cp_reduce_scatter(x, dim, groups)``: the sum over the cp ranks of a whole value, this rank's positions
  only (the gradient of ``cp_all_gather``); backward all-gathers;
* ``cp_all_reduce(x)``: the sum over the cp ranks (a token sum, a token count); backward all-reduces too;
* ``cp_halo(x, dim, left)``: each of this rank's two chunks with the ``left`` positions just before it in the
  sequence put in front (zeros before position 0), ``[before_a, chunk_a, before_b, chunk_b]`` along ``dim``: what a
  causal convolution of reach ``left`` reads (LFM2's and Mamba's ``conv1d(padding=k - 1)[..., :seqlen]``). The
  positions come from the chunk before (the last ``min(left, chunk)`` of every chunk all-gathered: a reach past a
  whole chunk reads several); backward is autograd's through that all-gather (its gradient reduce-scattered back to
  the ranks the positions came from);
* ``cp_unhalo(y, dim, left)``: the convolution of ``cp_halo``'s output without padding, the ``left`` outputs that
  straddle the two chunks dropped: this rank's positions;
* ``cp_cumsum(x, dim)`` / ``cp_logcumsumexp(x, dim)``: the running sum (log-sum-exp) along the sequence: each chunk's
  own, plus what every chunk before it adds up to (each chunk's total all-gathered, summed over the chunks before);
  backward is autograd's through that all-gather;
* ``cp_linear_scan(a, b, dim)``: the states of a first-order linear recurrence along the sequence, ``h[t] = a[t] *
  h[t - 1] + b[t]`` from ``h[-1] = 0`` (Mamba's selective scan written as a Python loop over the positions, which
  the trace unrolls: ``split/cp_loop.py``): each chunk run from zero, with the product of its ``a``; each chunk's
  product and last state all-gathered; the state entering a chunk folded from the chunks before it, and ``h = own +
  (running product of a) * entering``. Backward is autograd's through that all-gather;
* ``cp_amax(x, dims, keepdim)``: the maximum over ``dims`` (the sequence dim among them) of every cp rank's
  positions: each rank's own maximum, all-reduced with max. Backward sums the ranks' gradients (every rank's
  positions read the maximum) and gives the sum to the positions that hold the maximum, shared equally among them
  over every rank (as ``amax``'s own gradient shares it among ties).

Every backward is the adjoint of its forward over the whole group, so the sum of the cp ranks' parameter
gradients is ``cp`` times the gradient of the loss every rank computes; the data-parallel engine averages them
over dp x cp (``mesh.build_cp_mesh``). With no group set (one process) the ops are local. Imports torch only.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from .process_state import shared

_NAMESPACE = "tracepp"
_STATE = shared("context_parallel", {"group": None, "size": 1, "rank": 0})  # one per process (process_state)


def set_group(group, size: int, rank: int) -> None:
    """The process group of this rank's context-parallel peers (the ``cp`` dim of the job's mesh)."""
    _STATE.update(group=group, size=size, rank=rank)


def count_exchange(on: bool = True) -> None:
    """Count the bytes this rank receives in the cp all-gathers (forward; ``all_gather_backward``: the keys and values
    gathered again for backward) and sends in the reduce-scatters from now on (a measurement's:
    ``benchmarks/context_parallel.py``); :func:`exchanged` reads them."""
    _STATE["counts"] = {"all_gather": 0, "reduce_scatter": 0, "all_gather_backward": 0, "all_gather_calls": 0,
                        "reduce_scatter_calls": 0, "all_gather_backward_calls": 0} if on else None


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


def _joined(x: torch.Tensor, dim: int, groups: int = 1, counted: str = "all_gather") -> torch.Tensor:
    """Every rank's chunks joined in sequence order: chunk c < cp is rank c's first, chunk c >= cp is rank
    (2 cp - 1 - c)'s second."""
    cp = _STATE["size"]
    if cp == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=_STATE["group"])
    _count(counted, (cp - 1) * x.numel() * x.element_size())  # received from the other ranks
    views = [_grouped(part, dim, groups, 2) for part in parts]
    ordered = [views[c].narrow(dim + 1, 0, 1) for c in range(cp)]
    ordered += [views[2 * cp - 1 - c].narrow(dim + 1, 1, 1) for c in range(cp, 2 * cp)]
    shape = list(x.shape)
    shape[dim] = shape[dim] * cp
    out = x.new_empty(shape)  # (joined into it, not a view of a temporary: a model may write into a slice of it)
    torch.cat(ordered, dim=dim + 1, out=_grouped(out, dim, groups, 2 * cp))
    return out


def _repeated(x: torch.Tensor, repeats: int, head_dim: int) -> torch.Tensor:
    return x.repeat_interleave(repeats, dim=head_dim) if repeats > 1 else x


_GATHERED: dict = shared("context_gathered", {})  # key of a live cp_all_gather output -> (weakref, shard, args)


def _is_fake(tensor) -> bool:
    """A value without data: a fake or meta tensor (planning a stage's memory, ``tracepp.codegen.memory``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _key(tensor: torch.Tensor):
    """A gathered value's key: its data pointer, or for fake and meta tensors (memory planning) its storage's
    identity."""
    return ("fake", id(tensor.untyped_storage())) if _is_fake(tensor) else tensor.data_ptr()


def _remember(out: torch.Tensor, shard: torch.Tensor, args: tuple) -> None:
    """Inside a forward under :func:`kv_shards_kept_for_backward`: what backward keeps of ``out`` is ``shard``."""
    if _STATE["size"] > 1 and _STATE.get("record"):
        key = _key(out)
        _GATHERED[key] = (weakref.ref(out, lambda _ref, k=key: _GATHERED.pop(k, None)), shard.detach(), args)


def _gather(x: torch.Tensor, dim: int, groups: int = 1, repeats: int = 1, head_dim: int = 0) -> torch.Tensor:
    """``cp_all_gather``: the keys (or values) of every rank joined in sequence order, their heads repeated
    ``repeats`` times on ``head_dim`` (grouped-query attention's repeat, after the exchange: the bytes moved are the
    key/value heads'); remembered, so that what backward keeps of it is this rank's shard."""
    out = _repeated(_joined(x, dim, groups), repeats, head_dim)
    _remember(out, x, (dim, groups, repeats, head_dim))
    return out


def _pack(tensor: torch.Tensor):
    entry = _GATHERED.get(_key(tensor))
    gathered = entry[0]() if entry is not None else None
    if gathered is None or (gathered.untyped_storage() is not tensor.untyped_storage() if _is_fake(tensor) else
                            gathered.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()):
        return tensor
    _ref, shard, args = entry
    return (shard, args, tensor.size(), tensor.stride(), tensor.storage_offset())


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    shard, (dim, groups, repeats, head_dim), size, stride, offset = packed
    if _is_fake(shard):  # planning: the gathered value's bytes, no collective
        whole = list(shard.shape)
        whole[dim] *= _STATE["size"]
        whole[head_dim] *= repeats
        return shard.new_empty(whole).as_strided(size, stride, offset)
    return _repeated(_joined(shard, dim, groups, "all_gather_backward"), repeats, head_dim).as_strided(size, stride,
                                                                                                          offset)


def kv_shards_kept_for_backward():
    """A context under which a stage's forward lets autograd keep this rank's shard of each key/value all-gather
    output that attention saves (``q @ k.T`` keeps ``k``, ``probs @ v`` keeps ``v``), gathering it again when
    backward needs it, as Megatron-Core's all-gather context parallelism does: what backward keeps of the keys and
    values is 1/cp, for one more all-gather of each in backward. Hooks already set around the forward (sequence
    parallelism's, a measurement's) see what is kept."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    outer = top(False) if top is not None else None
    if outer is None:
        return _recording(torch.autograd.graph.saved_tensors_hooks(_pack, _unpack))
    outer_pack, outer_unpack = outer

    def pack(tensor):
        packed = _pack(tensor)
        if isinstance(packed, torch.Tensor):
            return ("whole", outer_pack(packed))
        return ("shard", outer_pack(packed[0]), packed[1:])

    def unpack(packed):
        if packed[0] == "whole":
            return outer_unpack(packed[1])
        return _unpack((outer_unpack(packed[1]),) + tuple(packed[2]))

    return _recording(torch.autograd.graph.saved_tensors_hooks(pack, unpack))


@contextlib.contextmanager
def _recording(hooks):
    _STATE["record"] = True
    try:
        with hooks:
            yield
    finally:
        _STATE["record"] = False
        _GATHERED.clear()


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


def _amax(x: torch.Tensor, dims, keepdim: bool = False) -> torch.Tensor:
    out = x.amax(dims, keepdim=True)
    if _STATE["size"] > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=_STATE["group"])
    return out if keepdim else out.squeeze(tuple(dims))


def halo_tails(x: torch.Tensor, dim: int, left: int) -> torch.Tensor:
    """The last ``min(left, chunk)`` positions of each of this rank's two chunks along ``dim``, side by side: what
    ``cp_halo`` sends."""
    xm = x.movedim(dim, -1)
    chunk = xm.shape[-1] // 2
    kept = min(left, chunk)
    return torch.cat([xm[..., chunk - kept:chunk], xm[..., 2 * chunk - kept:]], dim=-1).movedim(-1, dim)


def halo_assemble(x: torch.Tensor, joined: torch.Tensor, dim: int, left: int, cp: int, rank: int) -> torch.Tensor:
    """``cp_halo``'s output from this rank's ``x`` and every chunk's tails ``joined`` in sequence order (each
    ``min(left, chunk)`` long): a chunk's ``left`` positions before it are the last ``left`` of the tails of every
    chunk before it, after ``left`` zeros. Where ``left`` <= a chunk, that is the tail of the chunk just before it;
    past a chunk, the tails are whole chunks, so their concatenation is the sequence before it."""
    xm, jm = x.movedim(dim, -1), joined.movedim(dim, -1)
    chunk = xm.shape[-1] // 2
    kept = min(left, chunk)
    zeros = xm.new_zeros(tuple(xm.shape[:-1]) + (left,))
    pieces = []
    for index, which in enumerate(chunk_order(cp, rank)):
        before = torch.cat([zeros, jm[..., :which * kept]], dim=-1)
        pieces += [before[..., before.shape[-1] - left:], xm[..., index * chunk:(index + 1) * chunk]]
    return torch.cat(pieces, dim=-1).movedim(-1, dim)


def _halo(x: torch.Tensor, dim: int, left: int) -> torch.Tensor:
    """``cp_halo``: the tails all-gathered (``cp_all_gather``: in sequence order; its backward reduce-scatters)."""
    joined = torch.ops.tracepp.cp_all_gather.default(halo_tails(x, dim, left), dim)
    return halo_assemble(x, joined, dim, left, _STATE["size"], _STATE["rank"])


def _unhalo(y: torch.Tensor, dim: int, left: int) -> torch.Tensor:
    """``cp_unhalo``: ``y`` (``2 chunk + left`` along ``dim``) without the ``left`` positions between the chunks."""
    chunk = (y.shape[dim] - left) // 2
    return torch.cat([y.narrow(dim, 0, chunk), y.narrow(dim, chunk + left, chunk)], dim=dim)


def scan_chunks(x: torch.Tensor, dim: int, kind: str) -> tuple:
    """(each of this rank's two chunks scanned on its own along ``dim``, their totals side by side along ``dim``):
    ``kind`` "cumsum", "cumprod" or "logcumsumexp"."""
    xm = x.movedim(dim, -1)
    chunk = xm.shape[-1] // 2
    scan = {"cumsum": torch.cumsum, "cumprod": torch.cumprod, "logcumsumexp": torch.logcumsumexp}[kind]
    parts = [scan(xm[..., :chunk], -1), scan(xm[..., chunk:], -1)]
    return parts, torch.cat([part[..., -1:] for part in parts], dim=-1).movedim(-1, dim)


def scan_assemble(parts: list, joined: torch.Tensor, dim: int, kind: str, cp: int, rank: int) -> torch.Tensor:
    """The running values of this rank's chunks: each chunk's own (``parts``) combined with the totals of every
    chunk before it (``joined``: each chunk's total, in sequence order)."""
    totals = joined.movedim(dim, -1)
    out = []
    for part, which in zip(parts, chunk_order(cp, rank)):  # the same ops on every rank, chunk 0 too (plus nothing:
        before = totals[..., :which]                       # a sum of none, a log-sum-exp of none, -inf), so that
        if kind == "cumsum":                               # every rank's backward runs its collectives in one order
            out.append(part + before.sum(-1, keepdim=True))
        elif kind == "cumprod":                            # (a product of none: 1)
            out.append(part * before.prod(-1, keepdim=True))
        else:
            out.append(torch.logaddexp(part, before.logsumexp(-1, keepdim=True)))
    return torch.cat(out, dim=-1).movedim(-1, dim)


def linear_scan_chunks(a: torch.Tensor, b: torch.Tensor, dim: int) -> tuple:
    """(each of this rank's two chunks of ``h[t] = a[t] * h[t - 1] + b[t]`` run from a zero state, the running
    product of ``a`` over each, and the totals: each chunk's product of ``a`` and its last state, ``[2, 2, ...]``
    (chunk, then product / state) along dim 0). ``a`` and ``b`` broadcast to one shape; ``dim`` holds the positions."""
    am, bm = (t.movedim(dim, 0) for t in torch.broadcast_tensors(a, b))
    chunk = am.shape[0] // 2
    states, products = [], []
    for first in (0, chunk):
        h, p, hs, ps = torch.zeros_like(bm[0]), torch.ones_like(am[0]), [], []
        for t in range(first, first + chunk):  # the recurrence as the model runs it, on this chunk's positions
            h = am[t] * h + bm[t]
            p = p * am[t]
            hs.append(h)
            ps.append(p)
        states.append(torch.stack(hs))
        products.append(torch.stack(ps))
    totals = torch.stack([torch.stack([p[-1], h[-1]]) for p, h in zip(products, states)])
    return states, products, totals


def linear_scan_assemble(states: list, products: list, joined: torch.Tensor, dim: int, cp: int,
                         rank: int) -> torch.Tensor:
    """This rank's states of the recurrence: each chunk's own plus its running product of ``a`` times the state
    entering it, folded from the totals of every chunk before it (``joined``: ``[2 cp, 2, ...]`` in sequence order)."""
    out = []
    for own, product, which in zip(states, products, chunk_order(cp, rank)):
        entering = torch.zeros_like(own[0])
        for k in range(which):
            entering = joined[k, 0] * entering + joined[k, 1]
        out.append(own + product * entering)
    return torch.cat(out).movedim(0, dim)


def _linear_scan(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """``cp_linear_scan``: the chunks' totals all-gathered (``cp_all_gather``; its backward reduce-scatters)."""
    states, products, totals = linear_scan_chunks(a, b, dim)
    joined = torch.ops.tracepp.cp_all_gather.default(totals, 0).clone()  # (kept as it is for backward, as _scan's)
    return linear_scan_assemble(states, products, joined, dim, _STATE["size"], _STATE["rank"])


def _scan(kind: str):
    def scan(x: torch.Tensor, dim: int) -> torch.Tensor:
        parts, totals = scan_chunks(x, dim, kind)
        # a copy: what backward keeps of the totals (logsumexp keeps its input) is kept as it is, not gathered again
        # when backward needs it (kv_shards_kept_for_backward would, at a moment that differs between the ranks)
        joined = torch.ops.tracepp.cp_all_gather.default(totals, dim).clone()
        return scan_assemble(parts, joined, dim, kind, _STATE["size"], _STATE["rank"])
    scan.__name__ = f"_{kind}"
    return scan


def _register():
    if hasattr(getattr(torch.ops, _NAMESPACE), "cp_shard"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register.lib = lib  # keep the library alive for the life of the process
    lib.define("cp_shard(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("cp_positions(SymInt length, Device? device=None) -> Tensor")
    lib.define("cp_all_gather(Tensor x, int dim, int groups=1, int repeats=1, int head_dim=0) -> Tensor")
    lib.define("cp_reduce_scatter(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("cp_all_reduce(Tensor x) -> Tensor")
    lib.define("cp_amax(Tensor x, int[] dims, bool keepdim=False) -> Tensor")
    lib.define("cp_halo(Tensor x, int dim, int left) -> Tensor")
    lib.define("cp_unhalo(Tensor y, int dim, int left) -> Tensor")
    lib.define("cp_cumsum(Tensor x, int dim) -> Tensor")
    lib.define("cp_logcumsumexp(Tensor x, int dim) -> Tensor")
    lib.define("cp_cumprod(Tensor x, int dim) -> Tensor")
    lib.define("cp_linear_scan(Tensor a, Tensor b, int dim) -> Tensor")

    # composites of differentiable ops: autograd, fake tensors and the compiler go through them as through any
    # torch code (the rank and size are read when the op runs)
    lib.impl("cp_shard", _shard, "CompositeImplicitAutograd")
    lib.impl("cp_positions", _positions, "CompositeImplicitAutograd")
    lib.impl("cp_halo", _halo, "CompositeImplicitAutograd")  # through cp_all_gather, whose autograd is below
    lib.impl("cp_unhalo", _unhalo, "CompositeImplicitAutograd")
    lib.impl("cp_cumsum", _scan("cumsum"), "CompositeImplicitAutograd")  # through cp_all_gather, as cp_halo
    lib.impl("cp_logcumsumexp", _scan("logcumsumexp"), "CompositeImplicitAutograd")
    lib.impl("cp_cumprod", _scan("cumprod"), "CompositeImplicitAutograd")
    lib.impl("cp_linear_scan", _linear_scan, "CompositeImplicitAutograd")
    for name, forward in (("cp_all_gather", _gather), ("cp_reduce_scatter", _reduce_scatter),
                          ("cp_all_reduce", _all_reduce), ("cp_amax", _amax)):
        lib.impl(name, forward, "CPU")
        lib.impl(name, forward, "CUDA")

    def gather_fake(x, dim, groups=1, repeats=1, head_dim=0):  # remembered as the real one is (memory planning)
        shape = list(x.shape)
        shape[dim] = shape[dim] * _STATE["size"]
        shape[head_dim] = shape[head_dim] * repeats
        out = x.new_empty(shape)
        _remember(out, x, (dim, groups, repeats, head_dim))
        return out

    def scatter_fake(x, dim, groups=1):
        shape = list(x.shape)
        shape[dim] = shape[dim] // _STATE["size"]
        return x.new_empty(shape)

    torch.library.register_fake(f"{_NAMESPACE}::cp_all_gather", gather_fake, lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::cp_reduce_scatter", scatter_fake, lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::cp_all_reduce", lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::cp_amax", lambda x, dims, keepdim=False: x.amax(dims, keepdim),
                                lib=lib)

    def keep_dims(ctx, inputs, output):
        ctx.dim, ctx.groups = inputs[1], inputs[2] if len(inputs) > 2 else 1
        ctx.repeats, ctx.head_dim = (inputs[3], inputs[4]) if len(inputs) > 4 else (1, 0)

    def gather_backward(ctx, grad):  # each rank's queries contributed to every key: the sum, at its positions
        if ctx.repeats > 1:  # the repeated heads' gradients summed into their key/value head
            shape = list(grad.shape)
            grad = grad.reshape(shape[:ctx.head_dim] + [shape[ctx.head_dim] // ctx.repeats, ctx.repeats]
                                + shape[ctx.head_dim + 1:]).sum(ctx.head_dim + 1)
        return torch.ops.tracepp.cp_reduce_scatter.default(grad, ctx.dim, ctx.groups), None, None, None, None

    def scatter_backward(ctx, grad):
        return torch.ops.tracepp.cp_all_gather.default(grad, ctx.dim, ctx.groups), None, None

    def reduce_backward(_ctx, grad):  # every rank's copy of the sum reached its loss: their gradients add up
        return torch.ops.tracepp.cp_all_reduce.default(grad)

    torch.library.register_autograd(f"{_NAMESPACE}::cp_all_gather", gather_backward, setup_context=keep_dims,
                                    lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::cp_reduce_scatter", scatter_backward, setup_context=keep_dims,
                                    lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::cp_all_reduce", reduce_backward, lib=lib)

    def keep_amax(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)
        ctx.dims, ctx.keepdim = sorted(d % inputs[0].dim() for d in inputs[1]), len(inputs) > 2 and inputs[2]

    def amax_backward(ctx, grad):
        # every rank's positions read the maximum: its gradient is the sum of the ranks' (as cp_all_reduce's), given
        # to the positions that hold the maximum, shared equally among them on every rank
        x, out = ctx.saved_tensors
        if not ctx.keepdim:
            for d in ctx.dims:
                grad, out = grad.unsqueeze(d), out.unsqueeze(d)
        at = x == out
        count = torch.ops.tracepp.cp_all_reduce.default(at.sum(ctx.dims, keepdim=True).to(grad.dtype))
        return torch.ops.tracepp.cp_all_reduce.default(grad) * at / count, None, None

    torch.library.register_autograd(f"{_NAMESPACE}::cp_amax", amax_backward, setup_context=keep_amax, lib=lib)


_register()
