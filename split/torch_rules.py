"""torch's own sharding rules, asked about one op of a stage graph: what DTensor's sharding propagator says an op
does to a value sharded on one dim over ``tp`` ranks.

The tensor-parallel walk (``split/tensor_parallel.py``) has rules of its own for the ops whose sharding needs more
than one placement per tensor can say (a fused projection's segments, a ``[batch * seq]`` dim of per-sample
pieces, the parameters a linear shards). For any other op it asks torch: the placements of the op's inputs
(``Shard(dim)`` or ``Replicate()``) go to ``DTensor``'s propagator (``torch.distributed.tensor._ops``: the
strategies torch registers for every op it can shard), which answers with the output's placement and the
input placements it needs. The walk takes the answer when:

* the output is ``Shard(d)`` (or a tuple of them) and the sharded inputs are taken as they are: the op runs on
  the pieces (a ``stack`` of heads, a ``cumsum`` along another dim, an op nobody wrote a rule for);
* the output is ``Partial(sum)``: each rank holds a partial sum, and one all-reduce makes it whole (a
  contraction over the sharded dim);
* the only inputs to change are whole ones that do not carry a gradient, each read at its piece (a mask or a
  position table beside sharded heads).

Anything else (an input to be gathered, a sharded input to be re-sharded on another dim, an answer torch cannot
give) is None, and the walk makes the value whole, naming the op. Every answer is checked on shapes: the op run
on meta tensors of the local shapes must give the local shape the answer implies, so that no argument of the
graph needs rewriting (a size list naming the global size fails that and is refused). Imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

_MESHES: dict = {}


@dataclass
class Ruling:
    """What torch says of one op: the output's shard dim (per output for a tuple; None: whole), whether it is a
    partial sum, and the whole inputs to read at their piece (node -> dim)."""

    out: object  # an int, a list of int-or-None, or None
    partial: bool = False
    scatter: dict = field(default_factory=dict)


def _mesh(tp: int):
    """A one-dim DeviceMesh of ``tp`` ranks that never communicates (no process group: only its shape is read)."""
    if tp not in _MESHES:
        try:
            from torch.distributed.device_mesh import DeviceMesh

            _MESHES[tp] = DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)
        except Exception:  # a torch whose DeviceMesh needs a process group: no answers from torch
            _MESHES[tp] = None
    return _MESHES[tp]


def _static(val) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


_ANSWERS: dict = {}  # what torch said, by everything it was told (:func:`_question`): a model's layers ask alike
_MAX_ANSWERS = 100_000


def ask(node: fx.Node, dims: dict, tp: int, may_scatter) -> Ruling | None:
    """DTensor's ruling on ``node`` when the values in ``dims`` (node -> shard dim) are sharded and every other
    tensor input is whole; ``may_scatter(input)``: whether a whole input may be read at its piece. None where torch
    has no rule, would move a sharded input, or the ruling does not hold on the local shapes. Answers are
    remembered by the question (the op, its arguments' shapes, strides, dtypes and placements): the same op of
    every layer is asked once."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    question = _question(node, dims, tp, may_scatter)
    if question is None:
        return _ask(node, dims, tp, may_scatter)
    key, inputs = question
    if key not in _ANSWERS:
        if len(_ANSWERS) > _MAX_ANSWERS:
            _ANSWERS.clear()
        ruling = _ask(node, dims, tp, may_scatter)
        position = {arg: index for index, arg in enumerate(inputs)}
        _ANSWERS[key] = None if ruling is None else (
            tuple(ruling.out) if isinstance(ruling.out, list) else ruling.out, ruling.partial,
            tuple((position[arg], dim) for arg, dim in ruling.scatter.items()))
    answer = _ANSWERS[key]
    if answer is None:
        return None
    out, partial, scatter = answer
    return Ruling(list(out) if isinstance(out, tuple) else out, partial, {inputs[i]: dim for i, dim in scatter})


def _question(node: fx.Node, dims: dict, tp: int, may_scatter):
    """(a hashable key of everything :func:`_ask` reads of ``node``, its node inputs in the order read), or None
    where an argument cannot be a key (a symbolic shape, an unhashable constant)."""
    inputs: list = []

    def ref(arg):
        if isinstance(arg, fx.Node):
            val = arg.meta.get("val")
            if not _static(val):
                raise _NoRule
            inputs.append(arg)
            sharded = arg in dims
            return ("t", tuple(val.shape), tuple(val.stride()), val.dtype, dims[arg] if sharded else None,
                    None if sharded else bool(may_scatter(arg)))
        if isinstance(arg, (list, tuple)):
            return (type(arg).__name__,) + tuple(ref(a) for a in arg)
        return ("c", type(arg).__name__, arg)

    out = node.meta.get("val")
    outs = out if isinstance(out, (list, tuple)) else [out]
    if not all(_static(v) for v in outs):
        return None
    try:
        key = (node.target, tp, tuple(ref(a) for a in node.args),
               tuple((k, ref(v)) for k, v in node.kwargs.items()),
               tuple((tuple(v.shape), v.dtype) for v in outs), isinstance(out, (list, tuple)))
        hash(key)
    except (_NoRule, TypeError):
        return None
    return key, inputs


def _ask(node: fx.Node, dims: dict, tp: int, may_scatter) -> Ruling | None:
    mesh = _mesh(tp)
    if mesh is None:
        return None
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._op_schema import OpSchema
        from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
    except ImportError:
        return None
    inputs: list = []  # (node, spec) in the order the schema lists them

    def spec_of(arg):
        if isinstance(arg, fx.Node):
            val = arg.meta.get("val")
            if not _static(val):
                raise _NoRule
            placement = Shard(dims[arg]) if arg in dims else Replicate()
            spec = DTensorSpec(mesh, (placement,), TensorMeta(val.shape, val.stride(), val.dtype))
            inputs.append((arg, spec))
            return spec
        if isinstance(arg, (list, tuple)):
            return type(arg)(spec_of(a) for a in arg)
        return arg

    out_val = node.meta.get("val")
    if not (_static(out_val) or (isinstance(out_val, (list, tuple)) and all(_static(v) for v in out_val))):
        return None
    try:
        args = tuple(spec_of(a) for a in node.args)
        kwargs = {k: spec_of(v) for k, v in node.kwargs.items()}
    except _NoRule:
        return None
    propagator = DTensor._op_dispatcher.sharding_propagator
    info = (propagator.op_to_schema_info.get(node.target)
            or getattr(propagator, "op_to_schema_info_for_single_dim_strategy", {}).get(node.target))
    try:
        answer = propagator.propagate_op_sharding_non_cached(OpSchema(node.target, args, kwargs, schema_info=info))
    except Exception:  # no strategy registered for the op, or one that does not take these inputs
        return None
    scatter = {}
    if answer.redistribute_schema is not None:
        wanted = [a for a in _flat(answer.redistribute_schema.args_schema)
                  + _flat(list(answer.redistribute_schema.kwargs_schema.values())) if isinstance(a, DTensorSpec)]
        if len(wanted) != len(inputs):
            return None
        for (arg, have), want in zip(inputs, wanted):
            if have.placements == want.placements:
                continue
            if (isinstance(have.placements[0], Replicate) and isinstance(want.placements[0], Shard)
                    and may_scatter(arg)):
                scatter[arg] = want.placements[0].dim
                continue
            return None
    out = answer.output_spec
    if isinstance(out, DTensorSpec):
        placement = out.placements[0]
        # a plain sum only: torch's subclasses keep reduce_op "sum" for reductions that are not one (_NormPartial:
        # (sum of x^p)^(1/p), an F.normalize's L2 norm; the masked lookups of a vocabulary-sharded embedding): read as
        # a sum, the ranks' norms were all-reduced and the plan trained silently wrong. No ruling: the walk makes the
        # input whole where it needs it
        if type(placement) is Partial and placement.reduce_op == "sum":
            ruling = Ruling(None, partial=True, scatter=scatter)
        elif isinstance(placement, Shard):
            ruling = Ruling(placement.dim, scatter=scatter)
        else:
            return None
    elif isinstance(out, (list, tuple)) and all(isinstance(o, DTensorSpec) for o in out):
        dims_out = []
        for o in out:
            if isinstance(o.placements[0], Shard):
                dims_out.append(o.placements[0].dim)
            elif isinstance(o.placements[0], Replicate):
                dims_out.append(None)
            else:
                return None
        if all(d is None for d in dims_out):
            return None
        ruling = Ruling(dims_out, scatter=scatter)
    else:
        return None
    return ruling if _holds_locally(node, dims, ruling, tp) else None


class _NoRule(Exception):
    pass


def _flat(items) -> list:
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flat(item))
        else:
            out.append(item)
    return out


def _local(val, dim, tp: int):
    shape = list(val.shape)
    if dim is not None:
        if shape[dim] % tp:
            raise _NoRule
        shape[dim] //= tp
    return shape


def _holds_locally(node: fx.Node, dims: dict, ruling: Ruling, tp: int) -> bool:
    """The op run on meta tensors of the local shapes gives the local shape of the ruling: the graph's arguments
    (sizes, indices) need no rewriting, and every piece is equal."""
    def meta(arg):
        if isinstance(arg, fx.Node):
            val = arg.meta["val"]
            dim = dims.get(arg, ruling.scatter.get(arg))
            return torch.empty(_local(val, dim, tp), dtype=val.dtype, device="meta")
        if isinstance(arg, (list, tuple)):
            return type(arg)(meta(a) for a in arg)
        if isinstance(arg, torch.device):
            return torch.device("meta")
        return arg

    try:
        args = tuple(meta(a) for a in node.args)
        kwargs = {k: (torch.device("meta") if k == "device" else meta(v)) for k, v in node.kwargs.items()}
        got = node.target(*args, **kwargs)
        want = node.meta["val"]
        if isinstance(want, torch.Tensor):
            return list(got.shape) == (list(want.shape) if ruling.partial else _local(want, ruling.out, tp))
        return len(got) == len(want) and all(list(g.shape) == _local(w, d, tp)
                                             for g, w, d in zip(got, want, ruling.out))
    except Exception:
        return False
