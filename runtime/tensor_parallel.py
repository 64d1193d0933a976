"""Tensor parallelism inside a stage: the four collectives the split inserts into the stage graphs, and the
cutting of this rank's parameter shards.

``tracepp split --tp T`` finds the column-then-row pairs in each stage graph (``split/tensor_parallel.py``)
and rewrites the graph with these ops, so the rank script reads as Megatron's recipe does:

* ``torch.ops.tracepp.tp_copy(x)``: identity forward, all-reduce of the gradient backward (Megatron's *f*),
  before the column-parallel matmuls that read a replicated ``x``;
* ``torch.ops.tracepp.tp_all_reduce(x)``: sum over the tp group forward, identity backward (*g*), after a
  row-parallel matmul (its bias is added after the sum);
* ``torch.ops.tracepp.tp_all_gather(x, dim, groups)``: the shards joined along ``dim`` forward, this rank's
  slice of the gradient backward, where a sharded value meets an op that needs all of it (the head's logits);
* ``torch.ops.tracepp.tp_scatter(x, dim, groups)``: this rank's slice forward, the slices joined backward: a
  whole value read beside pieces of the same dim (a position table added to a sequence shard);
* ``torch.ops.tracepp.tp_piece(x, dim, groups)``: ``tp_scatter`` whose backward puts this rank's gradient piece in
  its place, zeros elsewhere, with no communication: a part of the whole value's gradient, summed over tp by a
  ``tp_copy`` further back (where ``split/tp_grads.py`` placed it: ProphetNet's relative position bias, read at each
  rank's heads, has its parts carried back to the layer input, which is summed anyway);
* ``torch.ops.tracepp.tp_head_group(x, dim, parts)``: of ``dim`` cut into ``parts`` equal groups (key/value
  heads fewer than the ranks, ``parts`` dividing ``tp``), the one this rank's query heads need: rank r takes group
  ``r * parts // tp``; backward puts the gradient in its place, zeros elsewhere, and sums it over the group (the
  ranks that share a group each hold a part of its gradient);
* ``torch.ops.tracepp.tp_owned_split(x, dim, sizes)``: a split of the sharded ``dim`` into pieces that each lie in
  one rank's block (heads one by one): this rank's pieces from its block, the others empty; backward joins the
  gradients of its pieces (StableLM's per-head norms run on each head's owner only);
* ``torch.ops.tracepp.tp_owned_select(x, dim, index, owner)``: on rank ``owner``, ``x.select(dim, index)`` of its
  piece of the sharded ``dim``, on the others zeros, so that ``tp_all_reduce`` after it makes the selected index
  whole on every rank; backward puts the gradient in its place on the owner, zeros elsewhere (x-transformers'
  selective attention: head 0's scores gate every head);
* ``torch.ops.tracepp.tp_parts(x, dim, segments)``: ``tp_scatter`` of a whole value whose dim holds unequal
  segments (a depthwise convolution's weight over a fused q, k, v): this rank's piece of each segment, side by side;
  backward gathers the pieces back into the whole;
* ``torch.ops.tracepp.tp_vocab_embedding(weight, ids, padding_idx, reduce)``: an embedding whose rows (the
  vocabulary) are split over the group: each rank looks up the ids it holds, zeros the rest, and the sum
  over the group is the full lookup (``reduce=False``: the partial lookup, for ``sp_reduce_scatter``);
* ``torch.ops.tracepp.tp_amax(x, dims, keepdim)``: the maximum over ``dims``, the sharded dim among them (an
  activation quantized by its largest magnitude over the features, read row-wise): each rank's maximum all-reduced
  by MAX; backward gives the gradient to the elements that hold it, ties shared over every rank's;
* ``torch.ops.tracepp.tp_vocab_rows(indices, rows)``: indices into a table split over the group by rows, made
  this rank's (-1 where another rank holds the row): an ``embedding_bag`` of the rank's rows, its other bags'
  entries weighted 0, summed by ``tp_all_reduce`` (product-key memory's values).

With ``--sequence-parallel`` (Megatron-Core's), the activations between the tensor-parallel regions are split
over the sequence dim, and two more ops take the place of ``tp_copy`` and ``tp_all_reduce``:

* ``torch.ops.tracepp.sp_all_gather(x, dim, groups)``: the sequence shards joined forward, the gradient
  reduce-scattered backward, before the column-parallel matmuls;
* ``torch.ops.tracepp.sp_reduce_scatter(x, dim, groups)``: the partial products summed and scattered over the
  sequence forward, the gradient gathered backward, after a row-parallel matmul or a vocabulary lookup.

``groups``: the dim holds that many equal segments, each split over the ranks (a ``[batch * seq]`` dim of
tokens, sharded per sample); 1 for a plain dim.

Every rank of a tp group computes the same replicated values (the same inputs, the same ops), so gradients of
replicated parameters agree without communication. The group is set once by the runtime
(:func:`set_group`); with none (one process, ``tp`` 1) the ops are local identities. Imports torch only.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from .process_state import shared

_NAMESPACE = "tracepp"
_STATE = shared("tensor_parallel", {"group": None, "size": 1, "rank": 0})  # one per process (process_state)


def set_group(group, size: int, rank: int) -> None:
    """The process group of this rank's tensor-parallel peers (the ``tp`` dim of the job's mesh)."""
    _STATE.update(group=group, size=size, rank=rank)


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    if _STATE["size"] > 1:
        dist.all_reduce(out, group=_STATE["group"])
    return out


def _pieces(tensor: torch.Tensor, dim: int, groups: int, whole: bool = True) -> torch.Tensor:
    """``tensor`` with ``dim`` split into ``(groups, rest)``: for a ``whole`` value the rank pieces are chunks of
    ``rest``; a rank's own piece (``whole=False``, one being joined) need only split into its segments."""
    shape = list(tensor.shape)
    if shape[dim] % (groups * (_STATE["size"] if whole else 1)):
        raise RuntimeError(f"a sequence-parallel dim of {shape[dim]} ({groups} segment(s)) does not split into "
                           f"{_STATE['size']} equal pieces: the sequence length must be a multiple of --tp "
                           f"{_STATE['size']} with --sequence-parallel (pad the batch, or split without "
                           f"--sequence-parallel)")
    return tensor.reshape(shape[:dim] + [groups, shape[dim] // groups] + shape[dim + 1:])


def _local_piece(tensor: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """This rank's piece of ``dim`` (of each of its ``groups`` segments), in storage of its own."""
    size = _STATE["size"]
    if size == 1:
        return tensor.clone()
    grouped = _pieces(tensor, dim, groups)
    piece = grouped.chunk(size, dim=dim + 1)[_STATE["rank"]]
    shape = list(tensor.shape)
    shape[dim] //= size
    out = tensor.new_empty(shape)  # an op's output never aliases its input (autograd, in-place users)
    out.view(piece.shape).copy_(piece)
    return out


def _placed(piece: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """This rank's piece of ``dim`` put where it lies in the whole, zeros elsewhere (``_local_piece`` undone on one
    rank: the ranks' results sum to the joined pieces). No communication."""
    size = _STATE["size"]
    if size == 1:
        return piece.clone()
    shape = list(piece.shape)
    shape[dim] *= size
    out = piece.new_zeros(shape)
    _pieces(out, dim, groups).chunk(size, dim=dim + 1)[_STATE["rank"]].copy_(_pieces(piece, dim, groups, whole=False))
    return out


def _gather(tensor: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """The rank pieces joined along ``dim`` (each segment's pieces side by side, segment after segment)."""
    size = _STATE["size"]
    if size == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=_STATE["group"])
    if groups == 1:
        return torch.cat(parts, dim=dim)
    shape = list(tensor.shape)
    shape[dim] *= size
    out = tensor.new_empty(shape)
    torch.cat([_pieces(part, dim, groups, whole=False) for part in parts], dim=dim + 1, out=out.view(
        list(tensor.shape[:dim]) + [groups, shape[dim] // groups] + list(tensor.shape[dim + 1:])))
    return out


_GATHERED: dict = shared("sequence_gathered", {})  # data_ptr of a live sp_all_gather output -> (weakref, _Regather)


def _sequence_gather(tensor: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """``sp_all_gather``: the shards joined; remembered, so that what backward keeps of it is the shard
    (:func:`shards_kept_for_backward`)."""
    out = _gather(tensor, dim, groups)
    if _STATE["size"] > 1 and _STATE.get("record"):  # inside a forward under shards_kept_for_backward
        pointer = out.data_ptr()
        _GATHERED[pointer] = (weakref.ref(out, lambda _ref, p=pointer: _GATHERED.pop(p, None)),
                              _Regather(tensor.detach(), dim, groups))
    return out


def _is_fake(tensor) -> bool:
    """A value without data: a fake or meta tensor (planning a stage's memory, ``tracepp.codegen.memory``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _fake_key(tensor: torch.Tensor):
    """Where fake and meta tensors have no data pointer: their storage's identity."""
    return ("fake", id(tensor.untyped_storage()))


class _Regather:
    """One ``sp_all_gather`` output as backward keeps it: the shard, and the value gathered again the first time a
    saved tensor needs it. A region's input is saved by each of its column-parallel linears (q, k and v; gate and
    up): they share one of these, so backward gathers once per region, not once per linear. The gathered value is
    held until every saving node has unpacked it (then only weakly: a later unpack, as zero-bubble's W may make,
    gathers again if it is gone)."""

    __slots__ = ("shard", "read", "dim", "groups", "pending", "held", "weak", "__weakref__")

    def __init__(self, shard, dim: int, groups: int):
        self.shard, self.dim, self.groups = shard, dim, groups
        self.read = None  # set where outer saved-tensor hooks keep the shard: ``shard`` is their packed form
        self.pending, self.held, self.weak = 0, None, None

    def value(self) -> torch.Tensor:
        gathered = self.held if self.held is not None else (self.weak() if self.weak is not None else None)
        if gathered is None:
            shard = self.read(self.shard) if self.read is not None else self.shard
            if _is_fake(shard):  # planning: the gathered value's bytes, no collective
                whole = list(shard.shape)
                whole[self.dim] *= _STATE["size"]
                gathered = shard.new_empty(whole)
            else:
                gathered = _gather(shard, self.dim, self.groups)
            self.weak = weakref.ref(gathered)
            if self.pending > 1:
                self.held = gathered
        self.pending -= 1
        if self.pending <= 0:
            self.held = None
        return gathered


def _pack(tensor: torch.Tensor):
    if _is_fake(tensor):
        entry = _GATHERED.get(_fake_key(tensor))
        gathered = entry[0]() if entry is not None else None
        if gathered is None or gathered.untyped_storage() is not tensor.untyped_storage():
            return tensor
        regather = entry[1]
        regather.pending += 1
        return (regather, tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.requires_grad)
    entry = _GATHERED.get(tensor.data_ptr())
    gathered = entry[0]() if entry is not None else None
    if gathered is None or tensor.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
        return tensor
    regather = entry[1]
    regather.pending += 1
    return (regather, tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.requires_grad)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    regather, size, stride, offset, _requires_grad = packed
    return regather.value().as_strided(size, stride, offset)


def shards_kept_for_backward():
    """A context under which a stage's forward lets autograd keep the sequence shard of each ``sp_all_gather``
    output it saves (a column-parallel linear's input), gathering it again when backward needs it, as
    Megatron-Core does: what backward keeps between the regions is 1/tp of the activations, for one more
    all-gather per region in backward. Hooks already set around the step (a measurement's) see what is kept."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    outer = top(False) if top is not None else None
    if outer is None:
        return _recording(torch.autograd.graph.saved_tensors_hooks(_pack, _unpack))
    outer_pack, outer_unpack = outer

    def pack(tensor):
        packed = _pack(tensor)
        if isinstance(packed, torch.Tensor):
            return ("whole", outer_pack(packed))
        regather = packed[0]
        if regather.read is None:  # the first node to save it: the outer hooks take the shard, once
            regather.shard, regather.read = outer_pack(regather.shard), outer_unpack
        return ("shard", packed)

    def unpack(packed):
        if packed[0] == "whole":
            return outer_unpack(packed[1])
        return _unpack(packed[1])

    return _recording(torch.autograd.graph.saved_tensors_hooks(pack, unpack))


@contextlib.contextmanager
def _recording(hooks):
    """``hooks`` active, and sp_all_gather remembering its outputs' shards, for the span of a forward."""
    _STATE["record"] = True
    try:
        with hooks:
            yield
    finally:
        _STATE["record"] = False
        _GATHERED.clear()


def _reduce_scatter(tensor: torch.Tensor, dim: int, groups: int = 1) -> torch.Tensor:
    """The sum over the group of ``tensor``, this rank's piece of ``dim`` only."""
    size = _STATE["size"]
    if size == 1:
        return tensor.clone()
    grouped = _pieces(tensor, dim, groups)
    shape = list(tensor.shape)
    shape[dim] //= size
    out = tensor.new_empty(shape)  # written through a view of the grouped shape: the output owns its storage
    if _STATE.get("scatter_tensor", True):
        # the rank pieces side by side in one buffer, rank-major ([size, ...]: one copy, as the list below makes),
        # and one reduce_scatter_tensor: on gloo 1.4x faster than the list form for a [4, 128, 256] fp32 value
        # (interleaved, 300 each; benchmarks/studies/tp_collectives_forms.py)
        rest = grouped.shape[dim + 1] // size
        pieces = grouped.reshape(list(grouped.shape[:dim + 1]) + [size, rest] + list(grouped.shape[dim + 2:]))
        flat = pieces.movedim(dim + 1, 0).contiguous()
        try:
            dist.reduce_scatter_tensor(out.view(-1), flat.view(-1), group=_STATE["group"])
            return out
        except (RuntimeError, NotImplementedError) as error:  # a backend without it: the list form from now on
            if not any(text in str(error).lower() for text in ("not support", "not implemented", "unsupported")):
                raise
            _STATE["scatter_tensor"] = False
    inputs = [piece.contiguous() for piece in grouped.chunk(size, dim=dim + 1)]
    dist.reduce_scatter(out.view(inputs[0].shape), inputs, group=_STATE["group"])
    return out


def _head_group(tensor: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """This rank's group of ``dim`` cut into ``parts`` (``parts`` divides the tp size), in storage of its own."""
    size, rank = _STATE["size"], _STATE["rank"]
    if size % parts or tensor.shape[dim] % parts:
        raise RuntimeError(f"tp_head_group: {tensor.shape[dim]} heads in {parts} groups over --tp {size}: the "
                           f"group count must divide both")
    return tensor.chunk(parts, dim=dim)[rank * parts // size].clone(memory_format=torch.contiguous_format)


def _head_group_backward(grad: torch.Tensor, shape, dim: int, parts: int) -> torch.Tensor:
    size, rank = _STATE["size"], _STATE["rank"]
    full = grad.new_zeros(shape)
    full.chunk(parts, dim=dim)[rank * parts // size].copy_(grad)
    return torch.ops.tracepp.tp_all_reduce.default(full)


def _register():
    if hasattr(getattr(torch.ops, _NAMESPACE), "tp_copy"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register.lib = lib  # keep the library alive for the life of the process
    lib.define("tp_copy(Tensor x) -> Tensor")
    lib.define("tp_all_reduce(Tensor x) -> Tensor")
    lib.define("tp_all_gather(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("tp_scatter(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("tp_piece(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("sp_all_gather(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("sp_reduce_scatter(Tensor x, int dim, int groups=1) -> Tensor")
    lib.define("tp_vocab_embedding(Tensor weight, Tensor indices, int padding_idx, bool reduce=True) -> Tensor")

    for name, forward in (("tp_copy", lambda x: x.clone()), ("tp_all_reduce", _all_reduce),
                          ("tp_all_gather", _gather), ("tp_scatter", _local_piece), ("tp_piece", _local_piece),
                          ("sp_all_gather", _sequence_gather),
                          ("sp_reduce_scatter", _reduce_scatter)):
        lib.impl(name, forward, "CPU")
        lib.impl(name, forward, "CUDA")

    def resized(factor):
        def fake(x, dim, groups=1):
            shape = list(x.shape)
            shape[dim] = shape[dim] * _STATE["size"] if factor > 0 else shape[dim] // _STATE["size"]
            return x.new_empty(shape)
        return fake

    torch.library.register_fake(f"{_NAMESPACE}::tp_copy", lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::tp_all_reduce", lambda x: torch.empty_like(x), lib=lib)
    for name, factor in (("tp_all_gather", 1), ("tp_scatter", -1), ("tp_piece", -1), ("sp_reduce_scatter", -1)):
        torch.library.register_fake(f"{_NAMESPACE}::{name}", resized(factor), lib=lib)

    def sequence_gather_fake(x, dim, groups=1):  # remembered as the real one is (memory planning on fake tensors)
        out = resized(1)(x, dim, groups)
        if _STATE["size"] > 1 and _STATE.get("record") and _is_fake(out):
            key = _fake_key(out)
            _GATHERED[key] = (weakref.ref(out, lambda _ref, k=key: _GATHERED.pop(k, None)),
                              _Regather(x.detach(), dim, groups))
        return out

    torch.library.register_fake(f"{_NAMESPACE}::sp_all_gather", sequence_gather_fake, lib=lib)

    def copy_backward(_ctx, grad):  # the opaque op, not its body: a compiled backward keeps the collective whole
        return torch.ops.tracepp.tp_all_reduce.default(grad)

    def reduce_backward(_ctx, grad):
        return grad

    def keep_dims(ctx, inputs, output):
        ctx.dim, ctx.groups = inputs[1], inputs[2] if len(inputs) > 2 else 1

    def gather_backward(ctx, grad):  # every rank computes the same from the gathered value: take its piece
        return torch.ops.tracepp.tp_scatter.default(grad, ctx.dim, ctx.groups), None, None

    def scatter_backward(ctx, grad):
        return torch.ops.tracepp.tp_all_gather.default(grad, ctx.dim, ctx.groups), None, None

    def piece_backward(ctx, grad):  # a part of the whole gradient, summed by a tp_copy where tp_grads placed it
        return _placed(grad, ctx.dim, ctx.groups), None, None

    def sp_gather_backward(ctx, grad):  # column-parallel consumers: each rank's gradient is a part of the sum
        return torch.ops.tracepp.sp_reduce_scatter.default(grad, ctx.dim, ctx.groups), None, None

    def sp_scatter_backward(ctx, grad):
        return torch.ops.tracepp.sp_all_gather.default(grad, ctx.dim, ctx.groups), None, None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_copy", copy_backward, lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::tp_all_reduce", reduce_backward, lib=lib)
    for name, backward in (("tp_all_gather", gather_backward), ("tp_scatter", scatter_backward),
                           ("tp_piece", piece_backward),
                           ("sp_all_gather", sp_gather_backward), ("sp_reduce_scatter", sp_scatter_backward)):
        torch.library.register_autograd(f"{_NAMESPACE}::{name}", backward, setup_context=keep_dims, lib=lib)

    def vocab_embedding(weight, indices, padding_idx, reduce=True):
        # a composite of differentiable ops: autograd and fake tensors go through it as through any torch code
        rows = weight.shape[0]
        first = _STATE["rank"] * rows
        outside = (indices < first) | (indices >= first + rows)
        local = (indices - first).masked_fill(outside, 0)
        local_padding = padding_idx - first if first <= padding_idx < first + rows else -1
        out = torch.ops.aten.embedding.default(weight, local, local_padding)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return torch.ops.tracepp.tp_all_reduce.default(out) if reduce else out  # else: the caller reduce-scatters

    lib.impl("tp_vocab_embedding", vocab_embedding, "CompositeImplicitAutograd")


def _owned_pieces(tensor: torch.Tensor, dim: int, sizes) -> list:
    """[(start in this rank's piece, length) or None] per piece of ``sizes`` (a split of the whole dim): the pieces
    inside this rank's block (``tensor`` is it), None for the others."""
    per, rank = tensor.shape[dim], _STATE["rank"]
    low, out, start = rank * per, [], 0
    for length in sizes:
        inside = low <= start and start + length <= low + per
        out.append((start - low, length) if inside else None)
        start += length
    return out


def _owned_split(tensor: torch.Tensor, dim: int, sizes: list) -> list:
    empty = list(tensor.shape)
    empty[dim] = 0
    return [tensor.narrow(dim, at[0], at[1]).clone(memory_format=torch.contiguous_format) if at is not None
            else tensor.new_empty(empty) for at in _owned_pieces(tensor, dim, sizes)]


def _owned_select(tensor: torch.Tensor, dim: int, index: int, owner: int) -> torch.Tensor:
    if owner == _STATE["rank"]:
        return tensor.select(dim, index).clone(memory_format=torch.contiguous_format)
    return tensor.new_zeros(tensor.shape[:dim] + tensor.shape[dim + 1:])


def _owned_select_backward(grad: torch.Tensor, shape, dim: int, index: int, mine: bool) -> torch.Tensor:
    out = grad.new_zeros(shape)
    if mine:
        out.select(dim, index).copy_(grad)
    return out


def _parts_piece(tensor: torch.Tensor, dim: int, segments: list) -> torch.Tensor:
    """This rank's piece of each of ``segments`` along ``dim``, side by side (a fused projection's rows)."""
    if _STATE["size"] == 1:
        return tensor.clone()
    return shard(tensor, dim, _STATE["size"], _STATE["rank"], segments)


def _parts_gather(tensor: torch.Tensor, dim: int, segments: list) -> torch.Tensor:
    """The pieces of every rank joined back into the whole, each segment's pieces in place."""
    if _STATE["size"] == 1:
        return tensor.clone()
    return original_layout(_gather(tensor, dim), dim, _STATE["size"], segments)


def _register_heads():
    """``tp_head_group``, ``tp_owned_split`` and ``tp_parts`` (a library fragment of their own: a runtime copy of
    an older tracepp may have registered the other ops in this process already)."""
    if hasattr(getattr(torch.ops, _NAMESPACE), "tp_head_group"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register_heads.lib = lib
    lib.define("tp_head_group(Tensor x, int dim, int parts) -> Tensor")
    lib.define("tp_owned_split(Tensor x, int dim, int[] sizes) -> Tensor[]")
    lib.define("tp_parts(Tensor x, int dim, int[] segments) -> Tensor")
    for device in ("CPU", "CUDA"):
        lib.impl("tp_head_group", _head_group, device)
        lib.impl("tp_owned_split", _owned_split, device)
        lib.impl("tp_parts", _parts_piece, device)

    def parts_fake(x, dim, segments):
        shape = list(x.shape)
        shape[dim] = shape[dim] // _STATE["size"]
        return x.new_empty(shape)

    torch.library.register_fake(f"{_NAMESPACE}::tp_parts", parts_fake, lib=lib)

    def parts_setup(ctx, inputs, output):
        ctx.dim, ctx.segments = inputs[1], list(inputs[2])

    def parts_backward(ctx, grad):  # every rank computed its pieces from the whole: the gradient pieces joined
        return _parts_gather(grad, ctx.dim, ctx.segments), None, None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_parts", parts_backward, setup_context=parts_setup, lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::tp_owned_split",
                                lambda x, dim, sizes: [x.new_empty([*x.shape[:dim], (at[1] if at else 0),
                                                                    *x.shape[dim + 1:]])
                                                       for at in _owned_pieces(x, dim, sizes)], lib=lib)

    def owned_setup(ctx, inputs, output):
        ctx.shape, ctx.dim = tuple(inputs[0].shape), inputs[1]
        ctx.pieces = _owned_pieces(inputs[0], inputs[1], inputs[2])
        ctx.like = inputs[0].new_empty(0)

    def owned_backward(ctx, grads):  # this rank's pieces tile its block: their gradients, in order
        parts = []
        for at, grad in zip(ctx.pieces, grads):
            if at is None:
                continue
            shape = list(ctx.shape)
            shape[ctx.dim] = at[1]
            parts.append(grad if grad is not None else ctx.like.new_zeros(shape))
        return torch.cat(parts, dim=ctx.dim), None, None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_owned_split", owned_backward, setup_context=owned_setup,
                                    lib=lib)

    def head_group_fake(x, dim, parts):
        shape = list(x.shape)
        shape[dim] = shape[dim] // parts
        return x.new_empty(shape)

    torch.library.register_fake(f"{_NAMESPACE}::tp_head_group", head_group_fake, lib=lib)

    def head_group_setup(ctx, inputs, output):
        ctx.shape, ctx.dim, ctx.parts = tuple(inputs[0].shape), inputs[1], inputs[2]

    def head_group_backward(ctx, grad):
        return _head_group_backward(grad, ctx.shape, ctx.dim, ctx.parts), None, None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_head_group", head_group_backward,
                                    setup_context=head_group_setup, lib=lib)


def _vocab_rows(indices: torch.Tensor, rows: int) -> torch.Tensor:
    """The indices into this rank's rows of a table split over the group (``rows`` each), -1 where another rank
    holds the row."""
    local = indices - _STATE["rank"] * rows
    return torch.where((local >= 0) & (local < rows), local, torch.full_like(local, -1))


def _fragment(op: str, schema: str, impl, fake):
    """One op in a library fragment of its own (as ``_register_heads``: a runtime copy of an older tracepp may hold
    the other ops): ``op(schema)`` run by ``impl`` on CPU and CUDA, ``fake`` its shapes. The library (kept alive by
    the caller), or None where the op is registered already."""
    if hasattr(getattr(torch.ops, _NAMESPACE), op):
        return None
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    lib.define(f"{op}{schema}")
    for device in ("CPU", "CUDA"):
        lib.impl(op, impl, device)
    torch.library.register_fake(f"{_NAMESPACE}::{op}", fake, lib=lib)
    return lib


def _register_vocab_rows():
    """``tp_vocab_rows``."""
    lib = _fragment("tp_vocab_rows", "(Tensor indices, int rows) -> Tensor", _vocab_rows,
                    lambda indices, rows: torch.empty_like(indices))
    if lib is not None:  # registered already: the library that holds it is kept where it was made
        _register_vocab_rows.lib = lib


def _register_owned_select():
    """``tp_owned_select``, and its backward."""
    lib = _fragment("tp_owned_select", "(Tensor x, int dim, int index, int owner) -> Tensor", _owned_select,
                    lambda x, dim, index, owner: x.new_empty(x.shape[:dim] + x.shape[dim + 1:]))
    if lib is None:
        return
    _register_owned_select.lib = lib

    def select_setup(ctx, inputs, output):
        ctx.shape, ctx.dim, ctx.index = tuple(inputs[0].shape), inputs[1], inputs[2]
        ctx.mine = inputs[3] == _STATE["rank"]  # read here: backward may run under another rank's state (verify)

    def select_backward(ctx, grad):  # the owner's gradient in its place; the others' zeros
        return _owned_select_backward(grad, ctx.shape, ctx.dim, ctx.index, ctx.mine), None, None, None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_owned_select", select_backward, setup_context=select_setup,
                                    lib=lib)


def _amax(x: torch.Tensor, dims, keepdim: bool = False) -> torch.Tensor:
    """The maximum over ``dims`` (the sharded dim among them) of every tp rank's piece: the local maximum, then
    all-reduced by MAX."""
    out = x.amax(dims, keepdim=True)
    if _STATE["size"] > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=_STATE["group"])
    return out if keepdim else out.squeeze(tuple(dims))


def amax_gradient(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor, dims, keepdim: bool, count_sum):
    """``tp_amax``'s backward on one rank: ``grad`` (whole: a reader beside pieces sums it over tp through its
    ``tp_copy``) given to this rank's elements that hold the maximum, shared equally among every rank's such
    elements (``count_sum``: the all-reduce sum of each rank's count, as torch's ``amax`` shares ties)."""
    dims = sorted(d % x.dim() for d in dims)
    if not keepdim:
        for d in dims:
            grad, out = grad.unsqueeze(d), out.unsqueeze(d)
    at = x == out
    return grad * at / count_sum(at.sum(dims, keepdim=True).to(grad.dtype))


def _register_amax():
    """``tp_amax``, and its backward."""
    lib = _fragment("tp_amax", "(Tensor x, int[] dims, bool keepdim=False) -> Tensor", _amax,
                    lambda x, dims, keepdim=False: x.amax(dims, keepdim))
    if lib is None:
        return
    _register_amax.lib = lib

    def amax_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)
        ctx.dims, ctx.keepdim = list(inputs[1]), len(inputs) > 2 and inputs[2]

    def amax_backward(ctx, grad):
        x, out = ctx.saved_tensors
        return amax_gradient(grad, x, out, ctx.dims, ctx.keepdim, _all_reduce), None, None

    torch.library.register_autograd(f"{_NAMESPACE}::tp_amax", amax_backward, setup_context=amax_setup, lib=lib)


_register()
_register_heads()
_register_vocab_rows()
_register_owned_select()
_register_amax()


# ---- this rank's shards

def shard(tensor: torch.Tensor, dim: int, size: int, rank: int, segments=None) -> torch.Tensor:
    """Rank ``rank``'s piece of ``tensor`` split in ``size`` equal parts along ``dim``, in storage of its own (a
    view would keep the whole tensor alive). With ``segments`` (a fused projection's parts along ``dim``: q, k, v
    or gate, up) the piece is the rank's part of each segment, side by side: the rows of its own heads."""
    if not segments:
        return tensor.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)
    parts = tensor.split(list(segments), dim=dim)
    return torch.cat([part.chunk(size, dim=dim)[rank] for part in parts], dim=dim).contiguous()


def original_layout(tensor: torch.Tensor, dim: int, size: int, segments) -> torch.Tensor:
    """The model's own layout of a segmented tensor gathered from its pieces (rank-major: rank 0's part of every
    segment, then rank 1's, ...): each segment's parts back together, in segment order."""
    if not segments:
        return tensor
    local = [s // size for s in segments]
    per_rank = [piece.split(local, dim=dim) for piece in tensor.chunk(size, dim=dim)]
    return torch.cat([torch.cat([parts[k] for parts in per_rank], dim=dim) for k in range(len(segments))], dim=dim)


def placement_of(manifest: dict, fqn: str):
    """The tensor-parallel shard dim of a parameter (0: column-wise or vocabulary, 1: row-wise), or None when
    it is replicated over the tp group."""
    entry = (manifest.get("tp") or {}).get("params", {}).get(fqn)
    return None if entry is None else entry.get("dim")


def partial_grads(manifest: dict) -> set:
    """FQNs of the replicated parameters whose gradient each tp rank holds a part of until the step ends (the split
    dropped their ``tp_copy``: ``split/tp_grads.py``): :class:`StepSums` sums them."""
    params = (manifest.get("tp") or {}).get("params", {})
    return {fqn for fqn, entry in params.items() if entry.get("grad") == "partial"}


class StepSums:
    """The gradients of :func:`partial_grads`' parameters summed over the tp group when a step ends, in one
    all-reduce of them all (Megatron-Core sums its sequence-parallel norms' and q/k layernorms' so). A step that adds
    to gradients already summed (accumulation over several ``step`` calls) sums only what it added: the gradients
    at its start are kept aside (:meth:`begin`) and only the difference is reduced (:meth:`end`)."""

    def __init__(self, params: list, group):
        self.params, self.group, self._before = params, group, None

    def _grads(self) -> list:
        from .mesh import local

        return [local(p.grad) if p.grad is not None else None for p in self.params]

    def begin(self) -> None:
        grads = self._grads()
        self._before = [g.detach().clone() if g is not None else None for g in grads] \
            if any(g is not None for g in grads) else None

    def end(self) -> None:
        grads = self._grads()
        present = [(k, g) for k, g in enumerate(grads) if g is not None]
        if not present:
            return
        before = self._before or [None] * len(grads)
        flat = torch.cat([(g - before[k] if before[k] is not None else g).reshape(-1).float() for k, g in present])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for k, grad in present:
            summed = flat[offset:offset + grad.numel()].view_as(grad).to(grad.dtype)
            grad.copy_(summed + before[k] if before[k] is not None else summed)
            offset += grad.numel()
        self._before = None


def segments_of(manifest: dict, fqn: str):
    """The segments of a fused projection's sharded dim (e.g. [q rows, k rows, v rows]), or None."""
    entry = (manifest.get("tp") or {}).get("params", {}).get(fqn) or {}
    return entry.get("segments") if entry.get("dim") is not None else None


def piece_for(manifest: dict, size: int, rank: int):
    """``piece(fqn, tensor)`` for ``weights.load_rank_state``: a sharded parameter's piece for tp rank ``rank``,
    anything else whole. Every rank of a tp group reads the same whole tensors (the same checkpoint or the same
    seeded ``model()``), so the pieces fit together exactly."""
    def piece(fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        dim = placement_of(manifest, fqn)
        return tensor if dim is None else shard(tensor, dim, size, rank, segments_of(manifest, fqn))
    return piece


def whole(manifest: dict, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
    """A parameter gathered whole (``mesh.full``) in the model's own layout: a fused projection's rows re-laid
    from the rank-major order the gather gives."""
    segments = segments_of(manifest, fqn)
    if not segments:
        return tensor
    return original_layout(tensor, placement_of(manifest, fqn), manifest["tp"]["size"], segments)


def distribute(state: dict, manifest: dict, tp_mesh) -> dict:
    """FQN -> DTensor over the ``tp`` mesh of this rank's loaded state (already cut by :func:`piece_for`):
    sharded parameters ``Shard(dim)``, the other parameters ``Replicate()``; buffers stay plain tensors. A fused
    projection's DTensor is over its rank-major layout (each rank's rows contiguous); checkpoints and ``--save``
    re-lay it (:func:`checkpoint_view`, :func:`whole`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for fqn, tensor in state.items():
        if not isinstance(tensor, torch.nn.Parameter) or hasattr(tensor, "device_mesh"):
            out[fqn] = tensor  # a buffer, or already distributed (a routed expert over the ep mesh)
            continue
        dim = placement_of(manifest, fqn)
        placement = Replicate() if dim is None else Shard(dim)  # pieces are equal: the global shape follows
        value = DTensor.from_local(tensor.detach(), tp_mesh, [placement], run_check=False)
        out[fqn] = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
    return out


# ---- checkpoints of fused projections, in the model's own layout

def _runs(start: int, count: int, total: int, size: int, segments) -> list:
    """[(position in the model's layout, position in the rank-major layout, length)] covering rank-major
    positions [start, start + count) of a dim of ``total`` with ``segments``."""
    per_rank = total // size
    local = [s // size for s in segments]
    local_starts = [sum(local[:k]) for k in range(len(local))]
    seg_starts = [sum(segments[:k]) for k in range(len(segments))]
    runs, at, end = [], start, start + count
    while at < end:
        rank, within = divmod(at, per_rank)
        k = max(i for i in range(len(local)) if local_starts[i] <= within)
        length = min(end - at, local_starts[k] + local[k] - within)
        runs.append((seg_starts[k] + rank * local[k] + within - local_starts[k], at, length))
        at += length
    return runs


class CheckpointPieces(torch.Tensor):
    """What torch.distributed.checkpoint sees of a fused projection's DTensor (or its optimizer state): this
    rank's rows as chunks of the tensor in the model's own layout, so a checkpoint is the same whatever --tp
    wrote it and loads into any tp (or none). A view for DCP only (it implements DCP's chunk protocol; no op
    runs on it): saving copies each chunk out, loading writes into the DTensor's local storage."""

    @staticmethod
    def __new__(cls, local, global_shape, chunks, for_save):
        out = torch.Tensor._make_wrapper_subclass(cls, global_shape, dtype=local.dtype, device=local.device)
        out._local, out._chunks, out._for_save = local, chunks, for_save
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a checkpoint view of a fused projection (only DCP reads it)")

    def __create_write_items__(self, fqn, _object):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                              properties=TensorProperties.create_from_tensor(self._local), size=self.size()))
                for offsets, sizes, _local in self._chunks]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, sizes, _local in self._chunks]

    def __get_tensor_shard__(self, index):
        for offsets, sizes, local in self._chunks:
            if torch.Size(offsets) == index.offset:
                view = self._local
                for dim, (start, length) in enumerate(zip(local, sizes)):
                    view = view.narrow(dim, start, length)
                return view.contiguous() if self._for_save else view
        raise ValueError(f"no chunk at {list(index.offset)} of {index.fqn}")


def checkpoint_view(manifest: dict, for_save: bool):
    """``view(fqn, tensor)``: what DCP saves or loads for a parameter (or its optimizer state, a DTensor of the
    same layout): a fused projection's :class:`CheckpointPieces`, anything else as it is."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size = (manifest.get("tp") or {}).get("size", 1)

    def view(fqn: str, tensor):
        segments = segments_of(manifest, fqn)
        if not segments or not hasattr(tensor, "device_mesh"):
            return tensor
        dim = placement_of(manifest, fqn)
        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                               tensor.placements)
        local = tensor.to_local()
        chunks = []
        for original, grouped, length in _runs(offsets[dim], sizes[dim], tensor.shape[dim], size, segments):
            chunk_offsets, chunk_sizes, local_offsets = list(offsets), list(sizes), [0] * len(sizes)
            chunk_offsets[dim], chunk_sizes[dim], local_offsets[dim] = original, length, grouped - offsets[dim]
            chunks.append((chunk_offsets, chunk_sizes, local_offsets))
        return CheckpointPieces(local, tensor.shape, chunks, for_save)
    return view
