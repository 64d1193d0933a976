"""Tensor parallelism read from the traced graph: which parameters each stage shards over ``--tp`` ranks, and
the stage graphs rewritten to run on the shards.

The plan is Megatron's, found rather than written by hand. Every value of a stage graph gets a placement: whole
(every tp rank holds all of it) or sharded on one dim (rank r holds the r-th of ``tp`` equal contiguous pieces
of each *segment* of that dim; most values have one segment, a fused projection's output has one per part).
Walking the graph in order:

* a linear whose weight is a 2-D parameter and whose input is whole becomes **column-wise** (weight and bias
  split on the output features); its input passes through ``tp_copy`` (identity forward, all-reduce of the
  gradient backward) and its output is sharded on the last dim. A linear is any of the spellings export keeps:
  ``linear(x, W, b)``, GPT-2's Conv1D ``addmm(b, x, W)`` / ``mm`` / ``matmul(x, W)`` with ``W`` stored
  ``[in, out]``, and ``matmul(x, W.T)`` (Falcon's ``FalconLinear``);
* a fused projection (``qkv``, ``gate_up``) whose output is cut on its features by ``split``, ``chunk`` or
  slices becomes column-wise with one segment per part: each rank holds the rows of its own heads in every part
  (its q, k and v rows; its gate and up rows), and the cuts take the local parts (``_segments_needed``);
* ops that keep a sharded dim apart (elementwise ops and casts, views that split it into heads or merge heads
  back, at every batch size, transposes, attention over the head dim, reductions over other dims, slices,
  indexing and concatenations of other dims, ``repeat_interleave`` of heads) carry the sharding through; a
  whole operand broadcast along the sharded dim (rotary tables, a per-head-dim norm weight, a per-token gate) is
  read as it is, and one that carries a gradient (by the graph's flow from the parameters, not export's
  metadata) goes through ``tp_copy`` so its gradient is summed; a parameter as wide as the sharded dim (the
  weight of a norm over the whole projection, OLMo2's q/k norms) is sharded with it;
* a mean or sum over the sharded dim (an RMSNorm over the whole sharded width) is computed from the partial
  sums: the local sum, ``tp_all_reduce``, divided by the whole count for a mean;
* a linear whose input is sharded on its last dim becomes **row-wise** (weight split on the input features):
  its partial product goes through ``tp_all_reduce`` and then takes the bias;
* an embedding whose weight is a parameter becomes **vocabulary-parallel** (``Shard(0)``);
* anything else that meets a sharded value gets it whole through ``tp_all_gather`` (the head's logits before
  the loss), and so do the stage's outputs: every value that crosses a stage boundary is replicated.

A column-wise linear whose output only ever gets gathered is kept only when it widens (the head: vocabulary
rows); otherwise it is replicated. A parameter must take one placement everywhere it is used (a tied
embedding and head, on one stage or two): where its uses disagree it is replicated. So is any dim that
``tp`` does not divide (grouped-query attention with fewer key/value heads than ``tp`` replicates its
attention), and whatever the model file's ``tp_plan`` (FQN pattern -> ``"replicate"``) names. Every
replication carries its reason: the op and the model's source line. Mixture-of-experts weights (grouped
matmuls) are replicated over tp: experts shard over ``--ep``.

The result, :class:`TPPlan`, is plain data for the manifest; :func:`apply` rewrites the stage graphs.
"""
from __future__ import annotations

import fnmatch
import functools
import operator
import os
import sys
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

import tracepp.runtime.tensor_parallel  # noqa: F401  (registers torch.ops.tracepp.tp_*)
from tracepp.split import plan_cost, torch_rules
from tracepp.split.cost import held_bytes
from tracepp.split.naming import frames
from tracepp.split.partition import _gradient_flags

aten = torch.ops.aten
TP = torch.ops.tracepp

_UNARY = {
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.silu.default, aten.gelu.default,
    aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.exp.default,
    aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.square.default,
    aten.lift_fresh_copy.default, aten.abs.default, aten.erf.default, aten.dropout.default, aten.silu_.default,
    aten.gelu_.default, aten.relu_.default, aten.tanh_.default, aten.sigmoid_.default, aten.log.default,
    aten.reciprocal.default, aten.softplus.default, aten.leaky_relu.default, aten.clamp.default,
    aten.hardtanh.default, aten.sin.default, aten.cos.default, aten.mish.default, aten.elu.default,
}
_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
    aten.minimum.default, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.add.Scalar,
    aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar,
    aten.add_.Tensor, aten.mul_.Tensor, aten.sub_.Tensor, aten.div_.Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.pow.Tensor_Tensor, aten.rsub.Scalar, aten.rsub.Tensor, aten.div.Tensor_mode,
}
_CATS = {aten.cat.default, aten.concatenate.default}  # (tensors, dim): concatenate is cat's NumPy name
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_FLATTENS = {aten.flatten.using_ints}  # a view with no size list to rewrite
_EXPANDS = {aten.expand.default, aten.broadcast_to.default}
_SLICES = {aten.slice.Tensor, aten.narrow.default, aten.select.int}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
_SUMMABLE = {aten.mean.dim, aten.sum.dim_IntList}  # over the sharded dim: from partial sums
_NORMS = {aten.layer_norm.default: 1, aten.rms_norm.default: 1, aten.native_layer_norm.default: 1}  # shape arg
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
_SDPA = {aten.scaled_dot_product_attention.default}
_CONVS = {aten.conv1d.default, aten.conv2d.default}  # (input, weight, bias, stride, padding, dilation, groups)
_MATMULS = {aten.matmul.default, aten.bmm.default}
_CONTRACTIONS = _MATMULS | {aten.mm.default, aten.einsum.default}
_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default}
_IGNORED = {aten._assert_tensor_metadata.default}
_TRIANGLES = {aten.tril.default, aten.triu.default}  # (x, diagonal): over the last two dims
_PADS = {aten.pad.default, aten.constant_pad_nd.default}  # (x, pad, ...): pad lists the last dims' (before, after)
_FRESH = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}  # (x, size)
_MIXED_CARRIES = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.transpose.int, aten.permute.default,
                  aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.contiguous.default, aten.alias.default}  # metadata checks: dropped by codegen
_CP_OPS = ("tracepp::cp_shard", "tracepp::cp_all_gather", "tracepp::cp_reduce_scatter", "tracepp::cp_all_reduce")
_END = sys.maxsize  # a slice to the end


@dataclass
class TPPlan:
    """Plain data: the tensor-parallel degree, each parameter's placement and the collectives per stage."""

    size: int
    params: dict = field(default_factory=dict)  # fqn -> {"dim", "role", "segments"?, "why"?}
    stages: list = field(default_factory=list)  # per stage: {"collectives", "replicated", "share"}
    sequence_parallel: dict = None  # with --sequence-parallel: the sequence length and the values sent sharded

    def to_json(self) -> dict:
        out = {"size": self.size, "params": self.params, "stages": self.stages}
        if self.sequence_parallel is not None:
            out["sequence_parallel"] = self.sequence_parallel
        return out


def _swapped(dim: int, ndim: int) -> int:
    """``dim`` of a tensor after its last two dims are swapped."""
    return dim if dim < ndim - 2 else 2 * ndim - 3 - dim


def _in_dim(weight_val, out_dim: int) -> int:
    """The input-feature dim of a linear's weight: the other one of a 2-D weight, dim 1 of a 3-D ``[experts, in,
    out]`` one (Llama 4's experts, each computed on every token by ``bmm``)."""
    return 1 if weight_val.dim() == 3 else 1 - out_dim


def _written(node) -> list:
    """The arguments ``node`` writes into, positional or keyword (an in-place op or an ``out=`` variant: its schema
    marks them written)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs[spec.name]
            for i, spec in enumerate(schema.arguments)
            if spec.alias_info is not None and spec.alias_info.is_write
            and (i < len(node.args) or spec.name in node.kwargs)]


def _view_root(node):
    """The value ``node`` is a view of (through reshapes, slices, transposes, expands): what an in-place write
    into ``node`` changes."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node) and (
            node.target in _VIEWS or node.target in _SLICES or node.target in _TRANSPOSES or node.target in _EXPANDS
            or node.target in (aten.unsqueeze.default, aten.squeeze.dim, aten.as_strided.default, aten.alias.default)):
        node = node.args[0]
    return node


def _writes(node) -> bool:
    """``node`` writes into one of its inputs."""
    return bool(_written(node))


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _sizes(val) -> list:
    """A value's sizes: Python ints where static, sympy expressions where symbolic (the per-node path compares
    ints; algebra only where a dim is symbolic)."""
    return [_symbolic(s.node.expr) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]


def _symbolic(expr):
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else expr


def _equal(a, b) -> bool:
    if isinstance(a, torch.SymInt):  # a raw size of a value (val.shape[d]): its expression, hashable for the cache
        a = _symbolic(a.node.expr)
    if isinstance(b, torch.SymInt):
        b = _symbolic(b.node.expr)
    if isinstance(a, (int, sympy.Integer)) and isinstance(b, (int, sympy.Integer)):
        return int(a) == int(b)
    return _equal_symbolic(a, b)


@functools.lru_cache(maxsize=65536)
def _equal_symbolic(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _prod(items):
    out = 1
    for item in items:
        out = out * item
    return _symbolic(out) if not isinstance(out, int) else out


def _ints(items) -> bool:
    return all(isinstance(i, int) or sympy.sympify(i).is_Integer for i in items)


def where(node) -> str:
    """``model.py:42`` of the model source that made ``node`` (its innermost frame), or ''."""
    found = frames(node.meta.get("stack_trace")) if isinstance(node, fx.Node) else []
    return f"{os.path.basename(found[-1][0])}:{found[-1][1]}" if found else ""


def _at(node) -> str:
    line = where(node)
    return f" at {line}" if line else ""


def _boundaries(segments) -> list:
    """[0, s0, s0+s1, ...] of a segment list."""
    out, total = [0], 0
    for size in segments:
        total += int(size)
        out.append(total)
    return out


def view_placement(in_sizes: list, out_sizes: list, dim: int, segments, tp: int):
    """(output dim, its segments or None) of a value sharded on ``dim`` (with ``segments``) through a view from
    ``in_sizes`` to ``out_sizes``, or None where the pieces would not stay whole. Handles the dim kept, split
    into heads (it must be the outer part), merged with the dims after it (it is the outer part) or with size-1
    dims around it (a batch of one), a merged dim of one segment per outer index split back, and a dim split into
    heads whose head count merges with the dims before it (``[batch, seq, heads * d] -> [batch * seq * heads, d]``:
    the sharded dim is read as ``[heads, d]`` sharded on the heads)."""
    found = _view_placement(in_sizes, out_sizes, dim, segments, tp)
    size, before = in_sizes[dim], _prod(in_sizes[:dim])
    if found is not None or segments or not _ints([size, before]) or int(before) == 0:
        return found
    for e in range(1, len(out_sizes) + 1):
        bound = _prod(out_sizes[:e])
        if not _ints([bound]) or int(bound) % int(before):
            continue
        heads = int(bound) // int(before)
        if 1 < heads < int(size) and int(size) % heads == 0 and heads % tp == 0:
            finer = list(in_sizes[:dim]) + [sympy.Integer(heads), sympy.Integer(int(size) // heads)] \
                + list(in_sizes[dim + 1:])
            found = _view_placement(finer, out_sizes, dim, None, tp)
            if found is not None:
                return found
    return None


def _view_placement(in_sizes: list, out_sizes: list, dim: int, segments, tp: int):
    if segments and len(segments) > 1 and _ints(segments) and len({int(p) for p in segments}) == 1:
        # k equal segments (a sharded dim merged with the dims before it: [batch, seq, heads] -> [rows]) are a
        # [k, piece] view sharded on the piece: place the view from that ([rows] -> [batch, seq, heads] back)
        finer = list(in_sizes[:dim]) + [len(segments), int(segments[0])] + list(in_sizes[dim + 1:])
        found = _view_placement(finer, out_sizes, dim + 1, None, tp)
        if found is not None:
            return found
    size = in_sizes[dim]
    before = _prod(in_sizes[:dim])
    starts = [e for e in range(len(out_sizes)) if _equal(_prod(out_sizes[:e]), before)]
    # size-1 dims give several candidates (a batch of one in front, a single head): the one that keeps as many
    # inner size-1 dims before the sharded dim as the input has (leading ones, a batch of one, do not count)
    units = _inner_units(in_sizes[:dim])
    same = [e for e in starts if _inner_units(out_sizes[:e]) == units]
    starts = ([e for e in same if not _equal(out_sizes[e], 1)] or same
              or [e for e in starts if not _equal(out_sizes[e], 1)])
    parts = list(segments) if segments else [size]
    if not starts:
        return _merged_with_outer(in_sizes, out_sizes, dim, parts)
    for e in starts[:1]:
        out = out_sizes[e]
        if _equal(out, size):
            return e, segments
        if not (_ints([size, out]) and _ints(parts)):
            return None
        size_i, out_i = int(size), int(out)
        if out_i < size_i and size_i % out_i == 0:  # split: the sharded dim is the outer part
            inner = size_i // out_i
            if (segments and len(parts) == out_i and all(int(p) == inner for p in parts) and e + 1 < len(out_sizes)
                    and _equal(out_sizes[e + 1], inner)):  # [b*s] of per-sample segments -> [b, s]
                return e + 1, None
            if any(int(p) % inner for p in parts):
                return None
            new = [int(p) // inner for p in parts]
            if any(p % tp for p in new):
                return None
            return e, (tuple(new) if len(new) > 1 else None)
        if out_i > size_i and out_i % size_i == 0:  # merge: the sharded dim is the outer part
            inner = out_i // size_i
            return e, (tuple(int(p) * inner for p in parts) if len(parts) > 1 else None)
        return None
    return None


def _inner_units(sizes: list) -> int:
    """Size-1 dims after the first larger one (a single head, not a batch of one)."""
    first = next((i for i, s in enumerate(sizes) if not _equal(s, 1)), len(sizes))
    return sum(1 for s in sizes[first:] if _equal(s, 1))


def _merged_with_outer(in_sizes: list, out_sizes: list, dim: int, parts: list):
    """A sharded dim merged with the dims before it ([batch, seq] of tokens flattened to [batch * seq]): the
    merged dim holds one copy of the pieces per outer index, i.e. segments; None where the view does not merge."""
    size = in_sizes[dim]
    for e in range(len(out_sizes)):
        outer = _prod(out_sizes[:e])
        for k in range(dim):
            if not _equal(_prod(in_sizes[:k]), outer):
                continue
            copies = _prod(in_sizes[k:dim])
            if not _ints([copies, size, out_sizes[e]] + parts) or int(copies) < 2:
                continue
            if int(out_sizes[e]) % (int(copies) * int(size)):
                continue
            inner = int(out_sizes[e]) // (int(copies) * int(size))
            if not any(_equal(_prod(in_sizes[dim + 1:dim + 1 + m]), inner) for m in range(len(in_sizes) - dim)):
                continue
            return e, tuple([int(p) * inner for p in parts] * int(copies))
    return None


class _Walk:
    """One pass over one stage graph under a set of replicated FQNs and the segments learned for fused
    projections: each value's placement and the edits."""

    def __init__(self, graph: fx.Graph, fqn_of: dict, tp: int, forced: set, needs_grad: dict,
                 fused: dict = None, sequence=None, received: dict = None, last: bool = False, mixed: dict = None,
                 whole_buffers: dict = None, gathered: dict = None, pieces: dict = None):
        self.graph, self.fqn_of, self.tp, self.forced = graph, fqn_of, tp, forced
        self.pieces = pieces or {}  # fqn -> dim: a parameter sharded where it is made (learned: _learn_pieces)
        self.gathered = gathered or {}  # FQNs of low-rank down-projections sharded with their output gathered
        self.gathered_out: dict = {}  # such a linear's output -> its shard dim: gathered once, for every user
        self.whole_buffers = whole_buffers or {}  # names of values written in place where a shard cannot be: kept whole
        self.buffers_wanted: dict = {}  # such a value found in this pass -> why
        self.mixed_parts = mixed or {}  # fused weight fqn -> indices of its parts computed whole (learned)
        self.mixed: dict = {}  # a fused output with whole parts (and what carries it) -> those parts' indices
        self.mixed_linears: dict = {}  # such a linear -> (input, weight, bias, out_dim, segments, whole parts)
        self.part: dict = {}  # a value cut from one part of a fused projection -> (weight fqn, part index)
        self.item_parts: dict = {}  # a cut of a fused projection -> per output its (fqn, part index) or None
        self.whole_parts: dict = {}  # fqn -> parts found needed whole in this pass (kv heads fewer than tp)
        self.needs_grad = needs_grad  # node -> carries a gradient (split.partition._gradient_flags)
        self.fused = fused or {}  # weight fqn -> segments of its output features (learned in an earlier pass)
        self.shard: dict = {}  # node -> sharded dim (absent: replicated)
        self.segs: dict = {}  # sharded node -> segments of that dim (absent: one)
        self.items: dict = {}  # a split's node -> per output (dim, segments) or None
        self.origin: dict = {}  # sharded node -> frozenset of the column-wise weight FQNs it comes from
        self.out_features: dict = {}  # column-wise weight fqn -> its output features
        self.roles: dict = {}  # linear/embedding node -> "colwise" | "rowwise" | "vocab"
        self.forms: dict = {}  # linear node -> (input, weight node, bias node, weight's output-feature dim)
        self.aliases: dict = {}  # transpose of a 2-D parameter -> its placeholder
        self.uses: dict = {}  # fqn -> set of dims (None: used replicated)
        self.param_segments: dict = {}  # fqn -> segments of its sharded dim
        self.gathers: list = []  # (consumer node, input node)
        self.copies: list = []  # (consumer node, replicated input node)
        self.sums: dict = {}  # mean/sum over the sharded dim -> count of the reduced elements (mean) or None
        self.cuts: dict = {}  # split/slice on the sharded dim -> the local pieces' arguments
        self.wants: dict = {}  # weight fqn -> set of cut points its output's consumers need (fused projections)
        self.unfusable: dict = {}  # weight fqn -> why its segmented output cannot be cut locally
        self.reasons: list = []
        # sequence parallelism: the traced sequence length (None: off), the received values that arrive as
        # sequence shards (placeholder name -> (dim, segments)), and what it adds
        self.sequence, self.received = sequence, received or {}
        self.kind: dict = {}  # sharded node -> "seq" for a sequence shard (absent: a tensor-parallel shard)
        self.reduce_scatters: dict = {}  # row-wise linear / vocabulary lookup -> (dim, groups) of its output
        self.sp_gathers: list = []  # (column-wise linear, its sequence-sharded input)
        self.scatters: list = []  # (consumer, whole input, dim of the input, groups): cut to this rank's piece
        self.head_groups: list = []  # (attention, whole key/value, head dim, head count): the group this rank needs
        self.owned_splits: dict = {}  # split of the sharded dim into pieces within ranks -> the pieces' sizes
        self.owned: dict = {}  # a piece (and what it goes through) -> the rank that computes it
        self.owned_cats: dict = {}  # the cat joining the pieces -> (dim, origin): sharded again
        self.conv_groups: dict = {}  # depthwise convolution over sharded channels -> its local groups
        self._made_of_params: dict = {}  # node -> computed from parameters alone (memo of _param_only)
        self.sends: dict = {}  # sequence-sharded value leaving the stage -> (dim, segments)
        self._claimed: set = set()  # (node, input) pairs a rule placed (no "whole" use recorded)
        self.last = last  # the last stage: its outputs go to the loss, whole
        for node in graph.nodes:
            self._visit(node)

    def reduced_in_backward(self) -> set:
        """The whole values whose gradient tp_copy sums over the group: those that carry one."""
        return {arg for _consumer, arg in self.copies if self.needs_grad.get(arg)}

    # -- helpers
    def _param(self, node):
        if not isinstance(node, fx.Node):
            return None
        if node in self.aliases:
            node = self.aliases[node]
        return self.fqn_of.get(node.name) if node.op == "placeholder" else None

    def _use(self, node, dim, segments=None) -> None:
        fqn = self._param(node)
        if fqn is None:
            return
        if node in self.aliases and dim is not None:  # a transposed weight: its last two dims swap
            dim = _swapped(dim, _val(node).dim())
        self.uses.setdefault(fqn, set()).add(dim)
        if dim is not None and segments:
            self.param_segments[fqn] = tuple(int(s) for s in segments)

    def _claim(self, node, arg, dim=None, segments=None) -> None:
        self._claimed.add((node, arg))
        self._use(arg, dim, segments)

    def _place(self, node, dim, segments=None, origin=frozenset(), kind=None) -> None:
        parts = {self.part[a] for a in node.all_input_nodes if a in self.part}
        if len(parts) == 1 and node not in self.part:
            self.part[node] = next(iter(parts))
        self.shard[node] = dim
        if segments:
            self.segs[node] = tuple(segments)
        if origin:
            self.origin[node] = frozenset(origin)
        if kind == "seq":
            self.kind[node] = "seq"

    def _kind_of(self, args) -> str:
        """The placement kind shared by the sharded ``args`` ("seq" or "tp"), or None where they differ."""
        kinds = {self.kind.get(a, "tp") for a in args if isinstance(a, fx.Node) and a in self.shard}
        return next(iter(kinds)) if len(kinds) == 1 else None

    @staticmethod
    def groups_of(segments) -> int:
        """The equal segments of a sequence shard ([batch * seq] of tokens): their count, else 0 (unequal)."""
        if not segments:
            return 1
        return len(segments) if len(set(segments)) == 1 else 0

    def _origin_of(self, args) -> frozenset:
        out = frozenset()
        for arg in args:
            out |= self.origin.get(arg, frozenset())
        return out

    def _carry(self, node, source, dim=None) -> None:
        """``node`` sharded as ``source`` is (on ``dim`` where the op moved it)."""
        self._place(node, self.shard[source] if dim is None else dim, self.segs.get(source),
                    self.origin.get(source, frozenset()), self.kind.get(source))
        if source in self.mixed:
            self.mixed[node] = self.mixed[source]

    def _whole_part(self, value) -> None:
        """``value``, cut from one part of a fused projection, is needed whole (a key/value part with fewer heads
        than --tp): the next pass computes that part whole and shards the others."""
        if value in self.part:
            fqn, index = self.part[value]
            self.whole_parts.setdefault(fqn, set()).add(index)

    def _gather(self, consumer, arg) -> None:
        self.gathers.append((consumer, arg))
        if arg in self.segs and self.kind.get(arg) != "seq":  # pieces of each part joined in the wrong order
            for fqn in self.origin.get(arg, ()):
                self.unfusable.setdefault(fqn, f"its parts are needed whole by {consumer.target}{_at(consumer)}")

    def _gather_all(self, node) -> None:
        for arg in node.all_input_nodes:
            if arg in self.shard:
                self._gather(node, arg)

    def _use_whole(self, node) -> None:
        for arg in node.all_input_nodes:
            if arg not in self.shard and (node, arg) not in self._claimed:
                self._use(arg, None)

    def _refuse(self, node, why: str) -> bool:
        self.reasons.append(f"{node.name} ({node.target}){_at(node)}: {why}")
        return False

    # -- the rules
    def _visit(self, node) -> None:
        WORK["visits"] += 1
        if node.op == "placeholder":
            if node.name in self.received:  # a sequence shard sent by the stage before
                dim, segments = self.received[node.name]
                self._place(node, dim, segments, kind="seq")
            fqn = self.fqn_of.get(node.name)
            if fqn in self.pieces and fqn not in self.forced:  # read at its piece by what it makes: sharded
                self._place(node, self.pieces[fqn])
                self._use(node, self.pieces[fqn])
            return
        if node.op == "output":
            for arg in node.all_input_nodes:
                if arg in self.shard and self.kind.get(arg) == "seq" and not self.last:
                    self.sends[arg] = (self.shard[arg], self.segs.get(arg))  # sent as it is: 1/tp of the bytes
                elif arg in self.shard:
                    self._gather(node, arg)
            return
        target = node.target
        if target in _IGNORED:
            return
        if node in self.owned:  # a piece of an owned split: computed by the rank that holds it
            for arg in node.all_input_nodes:
                if arg not in self.owned and arg not in self.owned_splits and self.needs_grad.get(arg):
                    self.copies.append((node, arg))  # only the owner's gradient is non-zero: summed over tp
            self._use_whole(node)
            return
        if node in self.owned_cats:
            dim, origin = self.owned_cats[node]
            self._place(node, dim, None, origin)
            return
        if self._alias(node):
            return
        form = self._linear_form(node)
        if form is not None:
            self._linear(node, *form)
            self._use_whole(node)
            return
        sharded = [a for a in node.all_input_nodes if a in self.shard]
        if node.name in self.whole_buffers and sharded:  # written in place later where a shard cannot be
            self._refuse(node, self.whole_buffers[node.name])
            self._gather_all(node)
            self._use_whole(node)
            return
        if target is aten.embedding.default and self._param(node.args[0]) is not None and not sharded:
            self._embedding(node)
            return
        if sharded and not self._propagate(node, target, sharded):
            said = len(self.reasons)
            if self._by_torch(node, sharded):  # torch's own rule for the op (DTensor's propagator)
                if said and self.reasons[-1].startswith(f"{node.name} ("):
                    self.reasons.pop()
            else:
                if not (self.reasons and self.reasons[-1].startswith(f"{node.name} (")):
                    self._refuse(node, f"needs the whole of {', '.join(a.name for a in sharded)}")
                self._want_whole_buffer(node)
                self._gather_all(node)
        self._use_whole(node)

    def _want_whole_buffer(self, node) -> None:
        """An in-place op (``copy_`` into a slice, ``index_put_``) refused while what it writes is sharded: a gather
        would take the write into a copy and lose it. The value it writes into (through its views) is asked to be
        whole from where it is made, and the stages are walked again (:func:`_settle`)."""
        for arg in _written(node):
            if not (isinstance(arg, fx.Node) and arg in self.shard):
                continue
            root = _view_root(arg)
            if root.op != "call_function":
                raise ValueError(f"{node.name} ({node.target}){_at(node)} writes in place into {root.name}, an "
                                 f"input of the stage sharded over --tp {self.tp}: tracepp cannot keep it whole; "
                                 f"replicate the module that makes it with the model file's tp_plan")
            self.buffers_wanted[root.name] = (f"written in place by {node.name} ({node.target}){_at(node)}, which "
                                              f"cannot write a shard: kept whole")

    def _by_torch(self, node, sharded) -> bool:
        """An op the rules here do not place, placed by torch's own sharding rule for it (DTensor's propagator,
        ``split/torch_rules.py``): the output sharded as it says, or a partial sum made whole by an all-reduce; a
        whole input that carries no gradient is read at its piece. Values with segments or sequence shards are
        not asked about (torch's placements cannot say what they are)."""
        if self._kind_of(sharded) != "tp" or any(a in self.segs for a in sharded):
            return False
        contraction = node.target in _CONTRACTIONS  # a whole operand read at its piece: its gradient joined
        ruling = torch_rules.ask(node, {a: self.shard[a] for a in sharded}, self.tp,
                                 lambda arg: (contraction or not self.needs_grad.get(arg)) and self._param(arg) is None)
        if ruling is None:
            return False
        for arg, dim in ruling.scatter.items():
            self.scatters.append((node, arg, dim, 1))
            self._claimed.add((node, arg))
        for arg in node.all_input_nodes:  # a whole input beside pieces: its gradient is summed over tp
            if arg not in self.shard and arg not in ruling.scatter and self.needs_grad.get(arg):
                self.copies.append((node, arg))
        origin = self._origin_of(sharded)
        if ruling.partial:
            self.sums[node] = None
            return True
        if isinstance(ruling.out, list):
            self.items[node] = [(d, None) if d is not None else None for d in ruling.out]
            self._place(node, next(d for d in ruling.out if d is not None), None, origin)
        else:
            self._place(node, ruling.out, None, origin)
        return True

    def _alias(self, node) -> bool:
        """A transpose of a 2-D parameter's dims or of a 3-D one's last two (``W.T`` in ``x @ W.T``, experts'
        ``bmm(x, W.transpose(1, 2))``: Inkling's shared experts): read through to the parameter."""
        if node.target not in _TRANSPOSES or not node.args or node.args[0] in self.aliases:
            return False
        source = node.args[0]
        if not (isinstance(source, fx.Node) and source.op == "placeholder" and source.name in self.fqn_of
                and _val(source).dim() in (2, 3)):
            return False
        ndim = _val(source).dim()
        if node.target is aten.transpose.int and sorted(d % ndim for d in node.args[1:3]) != [ndim - 2, ndim - 1]:
            return False
        if node.target is aten.permute.default and [d % ndim for d in node.args[1]] != list(range(ndim - 2)) + [
                ndim - 1, ndim - 2]:
            return False
        if node.target in (aten.t.default, aten.numpy_T.default) and ndim != 2:
            return False
        self.aliases[node] = source
        return True

    def _weight(self, node) -> bool:
        return self._param(node) is not None and _val(node).dim() == 2

    def _linear_form(self, node):
        """(input, weight node, bias node or None, the weight node's output-feature dim) of a linear of a 2-D
        parameter in any spelling export keeps, else None."""
        target, args = node.target, node.args
        if target is aten.linear.default and self._weight(args[1]):
            return args[0], args[1], (args[2] if len(args) > 2 else None), 0
        if (target is aten.addmm.default and self._weight(args[2]) and not node.kwargs
                and _val(args[1]).dim() == 2 and _val(args[0]).dim() == 1):
            return args[1], args[2], args[0], 1
        if target in (aten.mm.default, aten.matmul.default) and len(args) == 2 and self._weight(args[1]):
            return args[0], args[1], None, 1
        if (target in (aten.mm.default, aten.matmul.default) and len(args) == 2 and self._weight(args[0])
                and self._param(args[1]) is None and _val(args[1]).dim() >= 2):
            return args[1], args[0], None, 0  # W @ x (Mamba's dt_proj.weight @ dt): features on x's dim -2
        if (target in (aten.bmm.default, aten.matmul.default) and len(args) == 2 and self._param(args[1]) is not None
                and _val(args[1]).dim() == 3 and _val(args[0]).dim() == 3):
            return args[0], args[1], None, 2  # x @ W of a 3-D W [experts, in, out]: every expert on its rows
        return None

    def _linear(self, node, x, weight, bias, out_dim: int) -> None:
        fqn = self._param(weight)
        wval = _val(weight)
        ndim = len(_val(x).shape)
        left = node.args[0] is weight  # W @ x: the features on x's dim -2 and the output's
        features = ndim - 2 if left else ndim - 1
        entering = x in self.shard and self.kind.get(x) == "seq"  # a sequence shard entering the region
        if left and entering:
            self._gather(node, x)
            return
        if x in self.shard and not entering:
            segments = self.segs.get(x)
            if self.shard[x] == features and fqn not in self.forced:
                self.roles[node] = "rowwise"
                self.forms[node] = (x, weight, bias, out_dim)
                self._claim(node, weight, _in_dim(wval, out_dim), segments)
                self._scatter_output(node)
                return
            if not left and self.shard[x] < features and not segments and fqn not in self.forced:
                # rows sharded on a dim before the features (Inkling's per-head states @ a bank of profiles): each
                # row's product is its own, the weight whole on every rank, its gradient summed over tp
                for arg in (weight, bias):
                    if isinstance(arg, fx.Node) and self.needs_grad.get(arg, True):
                        self.copies.append((node, arg))
                    self._claimed.add((node, arg))
                self._carry(node, x)
                return
            if fqn not in self.forced:
                self._refuse(node, f"input sharded on dim {self.shard[x]}, not its features")
            self._gather_all(node)
            return
        out_features = wval.shape[out_dim]
        segments = self.fused.get(fqn)
        if fqn in self.mixed_parts and segments and fqn not in self.forced and not entering:
            return self._mixed_linear(node, x, weight, bias, out_dim, fqn, segments)
        if fqn in self.forced or int(out_features) % self.tp:
            if fqn not in self.forced:
                self.reasons.append(f"{fqn}: {out_features} output features, which --tp {self.tp} does not divide")
            if entering:
                self._gather(node, x)
            return
        self.roles[node] = "colwise"
        self.forms[node] = (x, weight, bias, out_dim)
        self.out_features[fqn] = int(out_features)
        self._claim(node, weight, out_dim, segments)
        if bias is not None:
            self._claim(node, bias, 0, segments)
        if entering:  # gathered over the sequence forward, its gradient reduce-scattered backward
            if self.groups_of(self.segs.get(x)):
                self.sp_gathers.append((node, x))
            else:
                self._gather(node, x)
        else:
            self.copies.append((node, x))
        self._claimed.add((node, x))
        dim = _val(node).dim() - (2 if left else 1)
        if fqn in self.gathered and not segments:  # a low-rank down-projection: its narrow output made whole
            self.gathered_out[node] = dim
            self.gathers.extend((user, node) for user in node.users)
            return
        self._place(node, dim, segments, {fqn})

    def _mixed_linear(self, node, x, weight, bias, out_dim, fqn, segments) -> None:
        """A fused projection whose key/value parts have fewer heads than --tp (GPTBigCode's multi-query
        ``c_attn``): the query part is column-wise on this rank's heads, the key/value parts are computed whole
        (as Megatron-Core replicates key/value heads). The weight is whole on every rank; the rewrite computes
        the sharded parts from this rank's rows (``tp_scatter`` of their slice: the gradient rows gathered back)
        with the input through ``tp_copy``, and the whole parts from their rows and the input as it is."""
        whole = frozenset(self.mixed_parts[fqn])
        self.mixed_linears[node] = (x, weight, bias, out_dim, tuple(segments), whole)
        self._use(weight, None)
        if bias is not None:
            self._use(bias, None)
        self._claimed.update({(node, weight), (node, x)} | ({(node, bias)} if bias is not None else set()))
        self._place(node, _val(node).dim() - 1, segments, {fqn})
        self.mixed[node] = whole
        self.out_features[fqn] = int(_val(weight).shape[out_dim])

    def _embedding(self, node) -> None:
        weight = node.args[0]
        fqn = self._param(weight)
        extra = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "padding_idx"]
        rows = _val(weight).shape[0]
        if fqn in self.forced or any(extra) or _val(weight).dim() != 2 or int(rows) % self.tp:
            if fqn not in self.forced:
                self.reasons.append(f"{fqn}: vocabulary of {rows} rows, which --tp {self.tp} does not divide"
                                    if int(rows) % self.tp else f"{fqn}: a sparse or frequency-scaled embedding")
            self._use(weight, None)
            return
        self.roles[node] = "vocab"
        self._claim(node, weight, 0)
        self._scatter_output(node)

    def _sequence_dim(self, val):
        """(dim, segments) of the sequence in a value (its tokens), or None: a dim of the traced sequence length
        other than the last (the features), or a leading [batch * seq] dim of per-sample segments."""
        if self.sequence is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
            return None
        sizes = _sizes(val)
        seq = self.sequence
        for d in range(val.dim() - 1):
            if _equal(sizes[d], seq):
                return (d, None) if not _ints([seq]) or int(seq) % self.tp == 0 else None
        if _ints([sizes[0], seq]) and int(sizes[0]) % int(seq) == 0 and int(seq) % self.tp == 0:
            count = int(sizes[0]) // int(seq)
            return 0, (tuple([int(seq)] * count) if count > 1 else None)
        return None

    def _scatter_output(self, node) -> None:
        """Sequence parallelism: a row-wise output or a vocabulary lookup (partial sums) is reduce-scattered over
        the sequence instead of all-reduced, and the activations after it are sequence shards."""
        found = self._sequence_dim(_val(node))
        if found is None:
            return
        dim, segments = found
        self.reduce_scatters[node] = (dim, self.groups_of(segments))
        self._place(node, dim, segments, kind="seq")

    def _propagate(self, node, target, sharded) -> bool:
        out_val = _val(node)
        if any(a in self.mixed for a in sharded) and not (
                target in _MIXED_CARRIES or target in _SPLITS or target in _SLICES or target is operator.getitem):
            for arg in sharded:
                for fqn in self.origin.get(arg, ()) if arg in self.mixed else ():
                    self.unfusable.setdefault(fqn, f"its parts, some whole, are read together by {target}{_at(node)}")
            return self._refuse(node, "reads a fused projection's output with parts of both kinds")
        if target is operator.getitem:
            entry = (self.items.get(node.args[0]) or [])
            if node.args[0] in self.items:
                if node.args[1] >= len(entry):
                    return False
                if entry[node.args[1]] is None:  # an output whole on every rank (torch's rule, a whole part)
                    self._claimed.add((node, node.args[0]))
                    return True
                dim, segments = entry[node.args[1]]
                parts = self.item_parts.get(node.args[0])
                if parts and parts[node.args[1]] is not None:
                    self.part[node] = parts[node.args[1]]
                self._place(node, dim, segments, self.origin.get(node.args[0], frozenset()),
                            self.kind.get(node.args[0]))
                return True
            self._carry(node, node.args[0])
            return True
        first = node.args[0]
        if target in _FRESH:
            return self._fresh_buffer(node, first)
        if target is aten.copy_.default:
            return self._fill(node)
        if target in _CATS:
            return self._cat(node)
        if target is aten.type_as.default:  # the second operand gives only its dtype
            if first in self.shard:
                self._carry(node, first)
            self._claimed.add((node, node.args[1]))
            return True
        if self._kind_of(sharded) is None:
            return self._refuse(node, "mixes sequence shards with tensor-parallel shards")
        if target in _NORMS:
            return self._norm(node, target, sharded)
        if target in _UNARY:
            if first not in self.shard or len(sharded) != 1:
                return False
            if target is aten.dropout.default and node.args[1] and (len(node.args) < 3 or node.args[2]):
                return self._refuse(node, "dropout draws a different mask on each rank: keep it whole or set p=0")
            self._carry(node, first)
            return True
        if target in _ELEMENTWISE:
            return self._elementwise(node, out_val)
        if target in _MATMULS:
            return self._batched_matmul(node)
        if target is aten.baddbmm.default:
            return self._baddbmm(node)
        if target is aten.einsum.default:
            return self._einsum(node)
        if target in _SDPA:
            return self._attention(node)
        if getattr(target, "name", lambda: "")() in _CP_OPS:  # --cp's collectives along the sequence: a shard of
            dim = node.args[1] % _val(first).dim() if len(node.args) > 1 else None  # another dim passes through
            if first not in self.shard or len(sharded) != 1 or dim == self.shard[first]:
                return False
            self._carry(node, first)
            return True
        if target in _CONVS:
            return self._depthwise_conv(node)
        if target is aten.gather.default:
            return self._gather_along(node)
        if first not in self.shard or len(sharded) != 1:
            return False
        dim = self.shard[first]
        in_val = _val(first)
        ndim = in_val.dim()
        if target is aten.unfold.default:  # windows along another dim, appended as a last dim (a short conv's lags)
            if node.args[1] % ndim == dim:
                return False
            self._carry(node, first)
            return True
        if target is aten.flip.default:  # reversed along other dims
            if dim in [d % ndim for d in node.args[1]]:
                return False
            self._carry(node, first)
            return True
        if target is aten.transpose.int:
            a, b = (d % ndim for d in node.args[1:3])
            self._carry(node, first, b if dim == a else a if dim == b else dim)
            return True
        if target in _PADS:  # pads the last len(pad) // 2 dims: local to any dim before them
            if dim >= ndim - len(node.args[1]) // 2:
                return False
            self._carry(node, first)
            return True
        if target in _TRIANGLES:  # masks each matrix of the last two dims: local to any dim before them (torch's
            if dim >= ndim - 2:   # own rule replicates)
                return False
            self._carry(node, first)
            return True
        if target is aten.permute.default:
            order = [d % ndim for d in node.args[1]]
            self._carry(node, first, order.index(dim))
            return True
        if target is aten.unsqueeze.default:
            at = node.args[1] % (ndim + 1)
            self._carry(node, first, dim + 1 if at <= dim else dim)
            return True
        if target in (aten.squeeze.dim, aten.squeeze.dims):
            ats = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
            ats = [a % ndim for a in ats if _equal(in_val.shape[a % ndim], 1)]
            if dim in ats:
                return False
            self._carry(node, first, dim - sum(1 for a in ats if a < dim))
            return True
        if target in _VIEWS or target in _FLATTENS:
            placed = view_placement(_sizes(in_val), _sizes(out_val), dim, self.segs.get(first), self.tp)
            if placed is not None and self.kind.get(first) == "seq" and not self.groups_of(placed[1]):
                placed = None
            if placed is None or (target in _VIEWS and not self._size_arg_ok(node.args[1], placed[0],
                                                                              _sizes(out_val)[placed[0]])):
                self._whole_part(first)
                return self._refuse(node, f"reshapes a dim of {in_val.shape[dim]} sharded over --tp {self.tp} "
                                          f"into {list(out_val.shape)}, whose pieces would not be whole heads "
                                          f"(fewer heads than --tp, e.g. key/value heads of grouped-query "
                                          f"attention)")
            self._place(node, placed[0], placed[1], self.origin.get(first, frozenset()), self.kind.get(first))
            return True
        if target in _EXPANDS:
            e = dim + out_val.dim() - ndim
            if not self._size_arg_ok(node.args[1], e, _sizes(out_val)[e]):
                return False
            self._carry(node, first, e)
            return True
        if target in _SLICES or target in _SPLITS:
            return self._cut(node, target, first, dim, in_val)
        if target is aten.index.Tensor:
            return self._index(node, first, dim, in_val, out_val)
        if target in _REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else None
            if not dims:
                return False
            dims = [d % ndim for d in dims]
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if dim in dims:
                return self._partial_sum(node, target, in_val, dims)
            self._carry(node, first, dim if keep else dim - sum(1 for d in dims if d < dim))
            return True
        if target is aten.repeat_interleave.self_int:
            if (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) is None:
                return False  # flattened
            self._carry(node, first)  # repeating heads in place keeps each rank's block contiguous
            return True
        if target in _SOFTMAX:
            if node.args[1] % ndim == dim:
                return False
            self._carry(node, first)
            return True
        return False

    def _norm(self, node, target, sharded) -> bool:
        """layer_norm / rms_norm over the trailing dims: a shard of another dim (a sequence shard, heads) is
        normalised as it is; its weight and bias are read whole (their gradients summed over tp)."""
        x = node.args[0]
        if sharded != [x] or x in self.segs and self.kind.get(x) != "seq":
            return False
        ndim = _val(x).dim()
        if self.shard[x] >= ndim - len(node.args[1]):
            return self._refuse(node, "normalises over the sharded dim")
        for arg in node.args[2:4]:
            if isinstance(arg, fx.Node) and self.needs_grad.get(arg):
                self.copies.append((node, arg))
        if target is aten.native_layer_norm.default:
            self.items[node] = [(self.shard[x], self.segs.get(x))] * 3
        self._carry(node, x)
        return True

    def _partial_sum(self, node, target, in_val, dims) -> bool:
        """A mean or sum over the sharded dim (an RMSNorm over the whole sharded width): the local sum, summed
        over the group (``tp_all_reduce``); a mean divides by the whole count. Its result is whole."""
        if target not in _SUMMABLE or node.kwargs.get("dtype") is not None or len(node.args) > 3:
            return self._refuse(node, f"a {target} over the sharded dim (only a sum or mean can be computed "
                                      f"from the pieces)")
        count = _prod([_sizes(in_val)[d] for d in dims])
        self.sums[node] = count if target is aten.mean.dim else None
        return True

    def _fresh_buffer(self, node, x) -> bool:
        """``x.new_empty(size)`` (new_zeros, new_full) as wide as sharded ``x`` on its sharded dim, filled by
        ``copy_`` into slices of other dims (DeepSeek's MLA writes its keys' no-rotary and rotary parts into one):
        allocated on this rank's piece when every write into it fits that piece as the walk has placed its source so
        far (sharded alike, or whole and broadcast along the dim; a source not yet walked counts as whole); any other
        in-place use keeps it whole."""
        dim, val, xval = self.shard[x], _val(node), _val(x)
        if (self.kind.get(x) == "seq" or x in self.mixed or val.dim() != xval.dim()
                or not _equal(val.shape[dim], xval.shape[dim])
                or not self._size_arg_ok(node.args[1], dim, _sizes(val)[dim])):
            return False
        fills = []
        for user in node.users:
            views = [user] if user.target is aten.copy_.default else []
            if user.target in _SLICES and user.args[0] is node:
                at = (user.args[1] if len(user.args) > 1 else 0) % val.dim()
                if at == dim:
                    return False
                views = list(user.users)
                if not all(v.target is aten.copy_.default and v.args[0] is user for v in views):
                    return False
            elif not views and _writes(user):
                return False  # another in-place write: not followed here
            for write in views:
                if write.args[0] is not node and write.args[0] is not user:
                    return False
                fills.append(write.args[1])
        if not fills or any(self._fits(src, dim, val.dim(), self.segs.get(x)) is None for src in fills):
            return False
        self._place(node, dim, self.segs.get(x), self.origin.get(x, frozenset()))
        return True

    def _fits(self, src, dim: int, ndim: int, segments):
        """How ``src`` is written into a piece of a buffer sharded on ``dim``: "sharded" (sharded alike), "broadcast"
        (size 1 there), "expand" (an expand of such a value read by this write alone: expanded to the piece), or
        None (whole and as wide as the dim)."""
        if not isinstance(src, fx.Node):
            return "broadcast"
        if src in self.shard:
            same = self.shard[src] + ndim - _val(src).dim() == dim and self.segs.get(src) == segments
            return "sharded" if same and self.kind.get(src) != "seq" else None
        sval = _val(src)
        if not isinstance(sval, torch.Tensor):
            return None
        at = dim - (ndim - sval.dim())
        if at < 0 or _equal(sval.shape[at], 1):
            return "broadcast"
        if src.target in _EXPANDS and len(src.users) == 1:
            inner = _val(src.args[0])
            at_in = at - (sval.dim() - inner.dim())
            if at_in < 0 or _equal(inner.shape[at_in], 1):
                return "expand"
        return None

    def _fill(self, node) -> bool:
        """``copy_`` into a piece of a buffer allocated on this rank's piece (:meth:`_fresh_buffer`)."""
        dst, src = node.args[0], node.args[1]
        if dst not in self.shard or self.kind.get(dst) == "seq":
            return False
        dim, ndim = self.shard[dst], _val(dst).dim()
        how = self._fits(src, dim, ndim, self.segs.get(dst))
        if how is None:
            return self._refuse(node, f"writes {getattr(src, 'name', src)} into a piece of a buffer sharded on dim "
                                      f"{dim}")
        if how == "expand":  # expanded to this rank's piece only; the gradient of what it expands summed over tp
            self._place(src, dim - (ndim - _val(src).dim()), self.segs.get(dst))
            if self.needs_grad.get(src.args[0]):
                self.copies.append((src, src.args[0]))
        elif how == "broadcast" and isinstance(src, fx.Node) and self.needs_grad.get(src):
            self.copies.append((node, src))
        self._claimed.add((node, src))
        self._carry(node, dst)
        return True

    def _cut(self, node, target, first, dim, in_val) -> bool:
        """split / chunk / unbind / slice / narrow / select: along another dim the sharding is kept; along the
        sharded dim each output must be whole parts of the value's segments (a fused projection's q, k, v): a cut
        elsewhere asks the projection for segments (learned, then walked again)."""
        ndim = in_val.dim()
        args = node.args
        if target in _SLICES:
            at = (args[1] if len(args) > 1 else node.kwargs.get("dim", 0)) % ndim
        elif target is aten.chunk.default or target is aten.unbind.int:
            at = (args[2] if len(args) > 2 else (args[1] if target is aten.unbind.int and len(args) > 1 else
                                                 node.kwargs.get("dim", 0))) % ndim
        else:
            at = (args[2] if len(args) > 2 else node.kwargs.get("dim", 0)) % ndim
        segments = self.segs.get(first)
        origin = self.origin.get(first, frozenset())
        kind = self.kind.get(first)
        if at != dim and first in self.mixed:
            return self._refuse(node, "cuts a fused projection's output with whole parts along another dim")
        if at != dim:
            if target in _SPLITS:
                count = len(_val(node)) if isinstance(_val(node), (list, tuple)) else 0
                out_dim = dim - 1 if target is aten.unbind.int and at < dim else dim
                self.items[node] = [(out_dim, segments)] * count
                self._place(node, out_dim, segments, origin, kind)
                return True
            self._place(node, dim - 1 if target is aten.select.int and at < dim else dim, segments, origin, kind)
            return True
        if kind == "seq":
            return self._refuse(node, "cuts the sequence dim of a sequence shard")
        size = in_val.shape[dim]
        if self._want_parts(node, target, origin, segments, in_val, dim):
            return False
        if target in (aten.select.int, aten.unbind.int) or not _ints([size]):
            return False
        size = int(size)
        ranges = self._ranges(node, target, size)
        if ranges is None:
            return self._refuse(node, "a cut of the sharded dim with a step or a computed size")
        have = _boundaries(segments or [size])
        cuts = sorted({p for r in ranges for p in r})
        if not set(cuts) <= set(have):
            wanted = set(cuts) | set(have)
            for fqn in origin:
                if self.out_features.get(fqn) == size:
                    self.wants.setdefault(fqn, set()).update(wanted)
            if not origin or any(self.out_features.get(f) != size for f in origin):
                if target in _SPLITS and not segments and self._owned_split(node, dim, size, ranges):
                    return True
                return self._refuse(node, f"cuts {size} sharded features at {cuts[1:-1]}, inside the pieces")
            return False
        pieces = []
        for start, end in ranges:
            inner = [b - a for a, b in zip(have, have[1:]) if a >= start and b <= end]
            pieces.append((dim, tuple(inner) if len(inner) > 1 else None))
        fqn = next(iter(origin)) if len(origin) == 1 and segments else None
        index_of = {start: k for k, start in enumerate(have[:-1])}
        parts = [(fqn, index_of[start]) if fqn is not None and end - start == int(segments[index_of[start]])
                 else None for start, end in ranges]
        whole = self.mixed.get(first, frozenset())
        if whole:  # a fused output whose whole parts every rank holds in full: local ranges of mixed sizes
            local = [int(p) if k in whole else int(p) // self.tp for k, p in enumerate(segments)]
            bounds = _boundaries(local)
            if any(part is None for part in parts):
                return self._refuse(node, "cuts a fused projection with whole parts inside its parts")
            self.cuts[node] = [(bounds[k], bounds[k + 1]) for _fqn, k in parts]
            pieces = [None if k in whole else (dim, None) for _fqn, k in parts]
            if target not in _SPLITS:
                if pieces[0] is None:
                    return self._refuse(node, "takes a whole part of a fused projection by a slice")
                self._place(node, dim, None, origin)
                self.part[node] = parts[0]
                return True
            self.items[node] = pieces
            self.item_parts[node] = parts
            self._place(node, dim, None, origin)
            return True
        self.cuts[node] = [(start // self.tp, end // self.tp) for start, end in ranges]
        if target in _SPLITS:
            self.items[node] = pieces
            self.item_parts[node] = parts
            self._place(node, dim, None, origin)
        else:
            self._place(node, dim, pieces[0][1], origin)
            if parts[0] is not None:
                self.part[node] = parts[0]
        return True

    def _want_parts(self, node, target, origin, segments, in_val, dim: int) -> bool:
        """A cut of a dim a view made by splitting a projection's features into ``[parts, rest]`` (Moshi's gated
        MLP: ``fc1(x).view(b, s, 2, -1)[..., 0, :]``), sharded on the parts: each part the cut takes is a range of
        the projection's features, ``rest`` wide, which the projection is asked to keep as segments (learned,
        then walked again: the view then shards each part)."""
        sizes = [in_val.shape[d] for d in range(dim, in_val.dim())]
        if segments or not origin or not _ints(sizes):
            return False
        size, rest = int(sizes[0]), int(_prod(sizes[1:]))
        if rest == 1 or any(self.out_features.get(fqn) != size * rest for fqn in origin):
            return False
        if target is aten.select.int:
            index = node.args[2] % size
            ranges = [(index, index + 1)]
        elif target is aten.unbind.int:
            ranges = [(k, k + 1) for k in range(size)]
        else:
            ranges = self._ranges(node, target, size)
        if not ranges:
            return False
        wanted = {0, size * rest} | {p * rest for r in ranges for p in r}
        for fqn in origin:
            self.wants.setdefault(fqn, set()).update(wanted)
        return True

    @staticmethod
    def _ranges(node, target, size: int):
        """The [start, end) ranges of the sharded dim each output of a cut takes (global), or None."""
        args = node.args
        if target is aten.slice.Tensor:
            start = args[2] if len(args) > 2 else node.kwargs.get("start", 0)
            end = args[3] if len(args) > 3 else node.kwargs.get("end", _END)
            step = args[4] if len(args) > 4 else node.kwargs.get("step", 1)
            if step != 1 or not all(v is None or isinstance(v, int) for v in (start, end)):
                return None
            start, end = (0 if start is None else start), (size if end is None else end)
            start = max(0, min(size, start + size if start < 0 else start))
            end = max(start, min(size, end + size if end < 0 else end))
            return [(start, end)]
        if target is aten.narrow.default:
            start, length = args[2], args[3]
            if not (isinstance(start, int) and isinstance(length, int)):
                return None
            start = start + size if start < 0 else start
            return [(start, start + length)]
        if target is aten.chunk.default:
            each = -(-size // args[1])
            sizes = [min(each, size - k) for k in range(0, size, each)]
        elif target is aten.split.Tensor:
            if not isinstance(args[1], int):
                return None
            sizes = [min(args[1], size - k) for k in range(0, size, args[1])]
        else:
            sizes = list(args[1])
            if not all(isinstance(s, int) for s in sizes):
                return None
        bounds = _boundaries(sizes)
        return list(zip(bounds, bounds[1:]))

    def _owned_split(self, node, dim: int, size: int, ranges) -> bool:
        """A split of the sharded dim into pieces no larger than a rank's (StableLM's per-head LayerNorms: the
        heads split one by one, each normalised by its own module of a ModuleList, then joined again): each piece
        lies inside one rank's block, and that rank computes it while the others hold it empty (``tp_owned_split``);
        what each piece goes through must be per-piece (casts, elementwise ops with operands broadcast along the
        dim, norms over other dims) and end in one ``cat`` of the pieces in order along the dim, whose result is
        sharded as the split's input was. A weight a piece reads is whole on every rank, its gradient summed over
        tp (the other ranks' parts are zero)."""
        if self.kind.get(node.args[0]) == "seq":
            return False
        per = size // self.tp
        owners = []
        for start, end in ranges:
            owner = start // per
            if end <= start or end > (owner + 1) * per:
                return False
            owners.append(owner)
        items = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        if sorted(items) != list(range(len(ranges))) or len(items) != len(node.users):
            return False
        chain, ends = {}, []
        for index in range(len(ranges)):
            value = items[index]
            chain[value] = owners[index]
            while True:
                users = list(value.users)
                if len(users) != 1:
                    return False
                user = users[0]
                if user.target in _CATS:
                    ends.append((value, user))
                    break
                if not self._per_piece(user, value, dim):
                    return False
                chain[user] = owners[index]
                value = user
        cats = {cat for _value, cat in ends}
        if len(cats) != 1:
            return False
        cat = next(iter(cats))
        ndim = _val(node.args[0]).dim()
        if list(cat.args[0]) != [value for value, _cat in ends] or (cat.args[1] if len(cat.args) > 1 else 0) % ndim != dim:
            return False
        self.owned_splits[node] = [end - start for start, end in ranges]
        self.owned.update(chain)
        self.owned_cats[cat] = (dim, self.origin.get(node.args[0], frozenset()))
        return True

    def _per_piece(self, node, value, dim: int) -> bool:
        """``node`` computes each element of ``value`` along ``dim`` on its own: a cast, an elementwise op whose
        other operands are broadcast along ``dim``, a norm over other dims."""
        target = node.target
        ndim = _val(value).dim()
        if target in _UNARY and target is not aten.dropout.default:
            return node.args[0] is value
        if target is aten.type_as.default:
            return node.args[0] is value
        if target in _NORMS:
            return node.args[0] is value and dim < ndim - len(node.args[1])
        if target in _ELEMENTWISE:
            for arg in node.args:
                if arg is value or not isinstance(arg, fx.Node):
                    continue
                val = _val(arg)
                if not isinstance(val, torch.Tensor):
                    continue
                at = dim - (_val(node).dim() - val.dim())
                if at >= 0 and not _equal(val.shape[at], 1):
                    return False
            return True
        return False

    def _index(self, node, first, dim, in_val, out_val) -> bool:
        """``x[..., idx]``: advanced indexing of other dims keeps the sharded dim (it may move)."""
        indices = list(node.args[1])
        if dim < len(indices) and indices[dim] is not None:
            return False
        if any(isinstance(i, fx.Node) and i in self.shard for i in indices):
            return False
        used = [k for k, i in enumerate(indices) if i is not None]
        e = dim if not used or min(used) > dim else dim + out_val.dim() - in_val.dim()
        if not (0 <= e < out_val.dim()) or not _equal(_sizes(out_val)[e], _sizes(in_val)[dim]):
            return False
        self._carry(node, first, e)
        return True

    def _cat(self, node) -> bool:
        parts = [p for p in node.args[0] if not (_val(p).dim() == 1 and _equal(_val(p).shape[0], 0))]  # cat skips
        #        a 1-D empty tensor (a cache that starts empty: XLM's keys)
        if not parts:
            return False
        ndim = _val(parts[0]).dim()
        at = (node.args[1] if len(node.args) > 1 else 0) % ndim
        dims = {self.shard.get(p) for p in parts if p in self.shard}
        if len(dims) != 1:
            return False
        dim = next(iter(dims))
        origin = self._origin_of(parts)
        whole = [p for p in parts if p not in self.shard]
        if whole:  # along another dim, a whole part as wide as the sharded dim (GPT-OSS's attention sinks beside
            #        the scores of each head) is read at this rank's piece; its gradient pieces are gathered back
            segments = {self.segs.get(p) for p in parts if p in self.shard}
            groups = self.groups_of(next(iter(segments))) if len(segments) == 1 else 0
            if at == dim or not groups or self._kind_of(parts) != "tp" or any(
                    _val(p).dim() != ndim or not _equal(_val(p).shape[dim], _val(parts[0] if parts[0] in self.shard else
                                                         next(q for q in parts if q in self.shard)).shape[dim])
                    for p in whole):
                return False
            self._read_whole(node, [(p, dim) for p in whole], groups)
        if at == dim:  # pieces of each part side by side: the parts are the segments
            segments = []
            for part in parts:
                segments.extend(self.segs.get(part) or [_sizes(_val(part))[dim]])
            if not _ints(segments):
                return False
            if self._kind_of(parts) == "seq":
                return False
            self._place(node, dim, tuple(int(s) for s in segments), origin)
            return True
        if len({self.segs.get(p) for p in parts}) != 1:
            return False
        self._place(node, dim, self.segs.get(parts[0]), origin, self._kind_of(parts))
        return True

    def _size_arg_ok(self, sizes, e: int, out_size) -> bool:
        """A view/expand's size list can be rewritten to the local size at dim ``e``: -1 there, or the global
        size as a literal int."""
        if not isinstance(sizes, (list, tuple)) or e >= len(sizes):
            return False
        at = sizes[e]
        return at == -1 or (isinstance(at, int) and _ints([out_size]) and at == int(out_size))

    def _elementwise(self, node, out_val) -> bool:
        n = out_val.dim()
        out_dim = segments = None
        first = True
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg in self.shard:
                e = self.shard[arg] + n - _val(arg).dim()
                if (out_dim is not None and out_dim != e) or (not first and self.segs.get(arg) != segments):
                    return False
                out_dim, segments, first = e, self.segs.get(arg), False
        broadcast, wide, cut = [], [], []
        for arg in node.args:
            if not isinstance(arg, fx.Node) or arg in self.shard:
                continue
            val = _val(arg)
            if not isinstance(val, torch.Tensor):
                continue
            at = out_dim - (n - val.dim())
            if at >= 0 and not _equal(val.shape[at], 1):
                if not _equal(val.shape[at], out_val.shape[out_dim]):
                    return False
                seq = self._kind_of(node.all_input_nodes) == "seq"
                if self._param(arg) is not None and not seq:
                    wide.append((arg, at))  # a weight as wide as the sharded dim: sharded with it
                    continue
                if (seq or not self.needs_grad.get(arg)) and self.groups_of(segments):
                    cut.append((arg, at))  # a whole value beside pieces (a position table, a mask): its piece
                    continue
                if not seq and self._param_only(arg):
                    cut.append((arg, at))  # made from weights alone (-exp(A_log), a bias per head): its piece
                    continue
                if not seq and self.groups_of(segments) and (out_dim < n - 1 or self._feeds_linear(node)):
                    # one that carries a gradient, beside pieces of heads (CPM-Ant's learned position bias added
                    # to the scores of each head) or gating a product on its way to a linear (Gemma's per-layer
                    # inputs): its piece, the gradient pieces gathered back. Not the residual stream beside a
                    # sharded output's features: that output is better made whole (a row-wise pair)
                    cut.append((arg, at))
                    continue
                return self._refuse(node, f"{arg.name} is whole and as wide as the sharded dim of "
                                          f"{', '.join(a.name for a in node.all_input_nodes if a in self.shard)}")
            broadcast.append(arg)
        for arg, at in wide:
            self._claim(node, arg, at, segments)
        for arg, at in cut:
            self.scatters.append((node, arg, at, self.groups_of(segments) or tuple(segments)))
            self._claimed.add((node, arg))
        for arg in broadcast:  # each rank sees its share of the sharded dim: the gradient is summed over tp
            if self.needs_grad.get(arg):
                self.copies.append((node, arg))
        self._place(node, out_dim, segments, self._origin_of(node.all_input_nodes),
                    self._kind_of(node.all_input_nodes))
        return True

    def _batched_matmul(self, node, operands=None) -> bool:
        """``q @ k.transpose(-1, -2)`` of eager attention, ``bmm`` of heads merged with the batch (Bloom's
        ``[batch * heads, seq, dim]``): operands sharded on the same batch dim (heads), with the same segments.
        Neither operand's matrix dims may be the sharded one (that would be a contraction or a cut of the rows).
        A whole operand as wide as that batch dim (a key repeated for grouped-query attention whose projection
        stays whole) is read at this rank's piece (``tp_scatter``; its gradient is gathered), one broadcast
        along it as it is (its gradient summed over tp)."""
        a, b = operands or node.args[:2]
        if self._kind_of([a, b]) != "tp":
            return False
        out = _val(node).dim()
        dims, segments = set(), set()
        for arg in (a, b):
            val = _val(arg)
            if arg in self.shard:
                d = self.shard[arg]
                if d >= val.dim() - 2:
                    return False
                dims.add(out - (val.dim() - d))
                segments.add(self.segs.get(arg))
        if len(dims) != 1 or len(segments) != 1:
            return False
        e, segs = next(iter(dims)), next(iter(segments))
        groups = self.groups_of(segs)
        reads, claims = [], []
        for arg in (a, b):
            if arg not in self.shard:
                val = _val(arg)
                at = e - (out - val.dim())
                if at < 0 or _equal(val.shape[at], 1):
                    reads.append((arg, None))
                elif _equal(val.shape[at], _val(node).shape[e]) and self._param(arg) is not None and not segs:
                    claims.append((arg, at))  # a weight per head (RecurrentGemma's block-diagonal gates): sharded
                elif _equal(val.shape[at], _val(node).shape[e]) and groups:
                    reads.append((arg, at))
                else:
                    return False
        for arg, at in claims:
            self._claim(node, arg, at)
        self._read_whole(node, reads, groups)
        self._place(node, e, segs, self._origin_of([a, b]))
        return True

    def _feeds_linear(self, node, depth: int = 4) -> bool:
        """``node``'s value reaches the input of a linear of a 2-D parameter through elementwise ops alone (a gated
        product on its way to a row-wise projection), not the residual stream (which meets a norm first)."""
        for user in node.users:
            form = self._linear_form(user)
            if form is not None and form[0] is node:
                return True
            if depth and (user.target in _UNARY or user.target in _ELEMENTWISE) and self._feeds_linear(user,
                                                                                                     depth - 1):
                return True
        return False

    def _param_only(self, node) -> bool:
        """``node`` is computed from parameters alone (``-A_log.exp()``, a weight reshaped): whole on every rank
        whatever the inputs, so reading it at a piece costs nothing forward (its gradient pieces are gathered)."""
        if node in self._made_of_params:
            return self._made_of_params[node]
        found = False
        if isinstance(node, fx.Node) and node not in self.shard:
            if node.op == "placeholder":
                found = node.name in self.fqn_of
            elif node.target is aten.type_as.default:  # the second operand gives only its dtype (OLMo-core's
                found = self._param_only(node.args[0])  # norm: ``weight.type_as(x)``)
            elif node.op == "call_function" and node.all_input_nodes:
                found = all(self._param_only(arg) for arg in node.all_input_nodes)
        self._made_of_params[node] = found
        return found

    def _read_whole(self, node, reads, groups=1) -> None:
        """Whole operands of an op on pieces: (input, dim) read at this rank's piece of ``dim`` (``tp_scatter``:
        each rank takes its piece, the gradient pieces are gathered back), or (input, None) broadcast along the
        sharded dim and read as it is (a gradient it carries is summed over tp: ``tp_copy``)."""
        for arg, at in reads:
            if at is not None:
                self.scatters.append((node, arg, at, groups))
                self._claimed.add((node, arg))
            elif self.needs_grad.get(arg):
                self.copies.append((node, arg))

    def _gather_along(self, node) -> bool:
        """``gather(x, dim, index)`` along a dim other than the sharded one (Inkling's relative-position bias per head,
        picked by distance): each output element reads its own row of x, so the output is sharded as x is; an index
        as wide as x's sharded dim (whole, an expanded table) is read at this rank's piece."""
        x, along, index = node.args[0], node.args[1], node.args[2]
        if (x not in self.shard or self.kind.get(x) == "seq" or x in self.segs
                or (node.args[3:] + tuple(node.kwargs.values())) not in ((), (False,))):  # sparse_grad=False
            return False
        d = self.shard[x]
        if along % _val(x).dim() == d:
            return False
        if index in self.shard:
            if self.shard[index] != d or self.segs.get(index) != self.segs.get(x):
                return False
        elif not _equal(_val(index).shape[d], _val(x).shape[d]) or self.needs_grad.get(index):
            return False
        else:
            self._read_whole(node, [(index, d)])
        self._carry(node, x)
        return True

    def _depthwise_conv(self, node) -> bool:
        """A depthwise convolution over sharded channels (``groups`` = channels: LFM2's short convolution, the causal
        conv1d of Mamba and gated delta-net mixers) mixes each channel with itself only, a grouped one (ZAYA's
        convolution per head: 6 groups of 16 channels) each group's channels with each other: where this rank's
        channels hold whole groups it runs on them, the whole weight and bias read at their rows (``tp_scatter``; the
        gradient rows gathered back), ``groups`` divided by tp."""
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
        held = [a for a in (weight, bias) if isinstance(a, fx.Node) and a in self.shard]  # sharded where made
        if (x not in self.shard or self.shard[x] != 1 or self.kind.get(x) == "seq" or not isinstance(groups, int)
                or any(self.shard[a] != 0 or a in self.segs or self.kind.get(a) == "seq" for a in held)
                or (held and x in self.segs)):
            return False
        channels, wval = _val(x).shape[1], _val(weight)
        parts = self.groups_of(self.segs.get(x))
        if not parts and self._param_only(weight) and (not isinstance(bias, fx.Node) or self._param_only(bias)):
            parts = tuple(self.segs[x])  # q, k and v channels of a fused projection: each read at its piece
        per = int(channels) // groups if _ints([channels]) and groups and int(channels) % groups == 0 else 0
        pieces = [int(p) // self.tp for p in (self.segs.get(x) or [channels])] if per else []
        if not (per and int(wval.shape[0]) == int(channels) and int(wval.shape[1]) == per and groups % self.tp == 0
                and parts and all(p % per == 0 for p in pieces)):
            return self._refuse(node, f"a convolution over sharded channels whose groups a rank's channels do not "
                                      f"hold whole (groups {groups} of {channels} channels)")
        self._read_whole(node, [(a, 0) for a in (weight, bias) if isinstance(a, fx.Node) and a not in held], parts)
        self.conv_groups[node] = groups // self.tp
        self._place(node, 1, self.segs.get(x), self.origin.get(x, frozenset()))
        return True

    def _baddbmm(self, node) -> bool:
        """``baddbmm(input, b1, b2)`` (Bloom's ALiBi scores): a batched matmul over heads plus ``input``, which is
        elementwise on the output: sharded with it, read at its piece (the ALiBi table, whole, per head), or
        broadcast."""
        bias = node.args[0]
        if not self._batched_matmul(node, node.args[1:3]):
            return False
        e, segs = self.shard[node], self.segs.get(node)
        if bias in self.shard:
            if self.shard[bias] + _val(node).dim() - _val(bias).dim() != e or self.segs.get(bias) != segs:
                return self._unplace(node)
            return True
        val = _val(bias)
        at = e - (_val(node).dim() - val.dim())
        if at < 0 or _equal(val.shape[at], 1):
            self._read_whole(node, [(bias, None)])
        elif _equal(val.shape[at], _val(node).shape[e]) and self.groups_of(segs) and (
                not self.needs_grad.get(bias) or self._param_only(bias)):  # a table, or a bias per head
            self._read_whole(node, [(bias, at)], self.groups_of(segs))
        else:
            return self._unplace(node)
        return True

    def _einsum(self, node) -> bool:
        """``einsum(equation, operands)`` spelling attention (x-transformers' and einops' ``b h i d, b h j d ->
        b h i j``, then ``b h i j, b h j d -> b h i d``): the sharded operands sharded on one label (the heads)
        that the output keeps (a batch label, not one summed over), with the same segments: the output is sharded
        on it. A whole operand with that label (a key repeated to the query heads) is read at this rank's piece, a
        weight with it is sharded with it, one without it is read as it is."""
        equation, operands = node.args[0], list(node.args[1])
        if not isinstance(equation, str) or "..." in equation or "->" not in equation:
            return False
        inputs, output = equation.replace(" ", "").split("->")
        specs = inputs.split(",")
        if len(specs) != len(operands) or self._kind_of(operands) != "tp":
            return False
        sharded = [(spec, arg) for spec, arg in zip(specs, operands) if arg in self.shard]
        if any(len(spec) != _val(arg).dim() for spec, arg in sharded):
            return False
        # the first operand sharded on a label the output keeps sets the placement (the queries, the scores); one
        # sharded otherwise (keys tiled to the query heads: their heads in segments) is gathered and read whole
        anchor = next((arg for spec, arg in sharded if output.count(spec[self.shard[arg]]) == 1), None)
        if anchor is None:
            return False  # summed over (a contraction of the sharded dim)
        label, segs = specs[operands.index(anchor)][self.shard[anchor]], self.segs.get(anchor)
        if any(spec.count(label) > 1 for spec in specs):
            return False  # a diagonal
        apart = [arg for spec, arg in sharded if spec[self.shard[arg]] != label or self.segs.get(arg) != segs]
        e, size = output.index(label), _val(node).shape[output.index(label)]
        reads, claims = [], []
        for spec, arg in zip(specs, operands):
            if arg in self.shard and arg not in apart:
                continue
            at = spec.find(label)
            val = _val(arg)
            if at < 0 or _equal(val.shape[at], 1):
                reads.append((arg, None))
            elif _equal(val.shape[at], size) and self._param(arg) is not None and not segs:
                claims.append((arg, at))
            elif _equal(val.shape[at], size) and self.groups_of(segs):
                reads.append((arg, at))
            else:
                return False
        for arg in apart:
            self._gather(node, arg)
        for arg, at in claims:
            self._claim(node, arg, at)
        self._read_whole(node, reads, self.groups_of(segs))
        self._place(node, e, segs, self._origin_of([a for a in operands if a in self.shard and a not in apart]))
        return True

    def _unplace(self, node) -> bool:
        """Undo a placement made before a later check failed (the edits recorded for ``node`` dropped)."""
        self.shard.pop(node, None)
        self.segs.pop(node, None)
        self.origin.pop(node, None)
        self.copies = [(c, a) for c, a in self.copies if c is not node]
        self.scatters = [entry for entry in self.scatters if entry[0] is not node]
        self._claimed = {(c, a) for c, a in self._claimed if c is not node}
        return False

    def _attention(self, node) -> bool:
        """``scaled_dot_product_attention`` on heads sharded alike (dim -3). A whole key or value (its projection
        stays whole: fewer key/value heads than --tp, multi-query) is read at the heads this rank's queries
        need, as Megatron-Core replicates them: its piece when it has one head per query head or a multiple of
        --tp heads (``tp_scatter``), its group when --tp is a multiple of its head count and ``enable_gqa`` pairs
        groups of query heads with it (``tp_head_group``), as it is when it has one head (``tp_copy``)."""
        q, k, v = node.args[:3]
        if q not in self.shard or self.shard[q] != _val(q).dim() - 3 or q in self.segs or q in self.kind:
            return False
        gqa = node.kwargs.get("enable_gqa", False)
        reads, groups, regathered = [], [], []
        heads = int(_val(q).shape[-3]) if _ints([_val(q).shape[-3]]) else None
        for t in (k, v):
            if t in self.shard:
                if self.shard[t] == _val(t).dim() - 3 and t not in self.segs and t not in self.kind:
                    continue
                if t in self.part or t in self.kind:
                    self._whole_part(t)  # a key/value part of a fused projection split inside its heads
                    return False
                # a key or value sharded on another dim (ZAYA's value: halves of each head from two projections,
                # each rank holding a piece of every head's features): every query head needs all of it, so it is
                # gathered here and read whole at this rank's heads below; the queries stay on their heads
                regathered.append(t)
            if heads is None or not _ints([_val(t).shape[-3]]):
                return False
            count = int(_val(t).shape[-3])
            if count == heads or (gqa and count % self.tp == 0 and heads % count == 0):
                reads.append((t, _val(t).dim() - 3))
            elif gqa and count == 1:
                reads.append((t, None))
            elif gqa and self.tp % count == 0 and heads % count == 0:
                groups.append((t, count))
            else:
                return self._refuse(node, f"{t.name} has {count} heads for {heads} query heads over --tp "
                                          f"{self.tp}: neither one per query head, a multiple of --tp, nor a "
                                          f"divisor of --tp")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            if mask in self.shard:
                if self.shard[mask] + 4 - _val(mask).dim() != 1:
                    return False
            else:
                mval = _val(mask)
                at = 1 - (4 - mval.dim())
                if at >= 0 and mval.shape[at] != 1:
                    if not _equal(mval.shape[at], heads):
                        return False
                    # a mask per head (ALiBi, a relative bias, Doge's dynamic mask computed from the values):
                    # this rank's heads; where it carries a gradient, the pieces' gradients are gathered back
                    reads.append((mask, at))
                elif self.needs_grad.get(mask):
                    reads.append((mask, None))
        for t in regathered:
            self._refuse(node, f"reads {t.name} sharded on dim {self.shard[t]}, not on its heads: gathered, then "
                               f"read at this rank's heads")
            self._gather(node, t)
        self._read_whole(node, reads)
        for t, count in groups:
            self.head_groups.append((node, t, _val(t).dim() - 3, count))
            self._claimed.add((node, t))
        self._place(node, self.shard[q], None, self._origin_of([q] + [t for t in (k, v) if t not in regathered]))
        return True


def _regions(walk: _Walk) -> list:
    """Connected groups of sharded values; each with its column-wise linears and whether one ends row-wise."""
    parent: dict = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    tp_sharded = [node for node in walk.shard if walk.kind.get(node) != "seq"]  # sequence shards join nothing
    gathered = set(walk.gathers)  # a value made whole before an op (a value attention gathers) joins nothing there
    for node in tp_sharded + list(walk.sums):  # a sum over pieces joins what it reads (a contraction: both sides)
        for arg in node.all_input_nodes:
            if arg in walk.shard and walk.kind.get(arg) != "seq" and (node, arg) not in gathered:
                parent[find(node)] = find(arg)
    groups: dict = {}
    for node in tp_sharded:
        groups.setdefault(find(node), set()).add(node)
    for node, role in walk.roles.items():
        if role == "rowwise":
            groups.setdefault(find(walk.forms[node][0]), set()).add(node)
    for node in walk.sums:
        groups.setdefault(find(node), set()).add(node)
    return list(groups.values())


def _narrow_columns(walk: _Walk) -> dict:
    """{weight FQN: why} of column-wise linears whose sharded output never reaches a row-wise linear or a sum
    over the pieces and is needed whole before the stage's end: the gather would cost what the shard saves. A
    column-wise linear whose output is gathered only to leave the stage (the head's logits) is kept."""
    out = {}
    for region in _regions(walk):
        if any(walk.roles.get(n) == "rowwise" for n in region):
            continue
        inside = [consumer for consumer, arg in walk.gathers if arg in region and consumer.op != "output"
                  and arg not in walk.gathered_out]
        if not inside:
            continue
        why = f"its output is needed whole by {inside[0].target}{_at(inside[0])}"
        for node in region:
            if walk.roles.get(node) == "colwise":
                out[walk._param(walk.forms[node][1])] = why
    return out


def fqn_map(stage, graph) -> dict:
    """Placeholder node name -> FQN of the stage's parameters (the state placeholders come first, in order)."""
    nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
    return {node.name: graph.state[name].fqn for node, name in zip(nodes, stage.state)
            if graph.state[name].kind == "parameter"}


def grad_flags(stage, graph) -> dict:
    """Which values of a stage graph carry a gradient: downstream of its parameters or of a received value that
    does (placeholders: state, root inputs, received values, in that order)."""
    nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
    first = len(stage.state) + len(stage.root_inputs)
    received = {nodes[first + i].name for i, (_producer, name) in enumerate(stage.received)
                if graph.values[name].meta.requires_grad}
    return _gradient_flags(stage.graph, set(fqn_map(stage, graph)) | received)


def _forced_by_overrides(aliases: dict, overrides) -> dict:
    """{fqn: why} of the parameters the model file's ``tp_plan`` replicates; a value it does not know is refused."""
    notes = {}
    for pattern, how in (overrides or {}).items():
        if how not in ("colwise", "rowwise", "replicate"):
            raise ValueError(f"tp_plan[{pattern!r}] = {how!r}: use 'colwise', 'rowwise' or 'replicate'")
        for fqn, names in aliases.items():
            if how == "replicate" and any(fnmatch.fnmatchcase(name, pattern) for name in names):
                notes[fqn] = f"tp_plan {pattern!r}"
    return notes


def _piece_of(walk: _Walk, node, dim):
    """(placeholder, dim) of the one parameter that ``node`` is made from by ops of one input that keep its sizes apart from
    dims of 1 (casts, ``exp``, ``neg``, ``unsqueeze``: Mamba's ``-exp(A_log.float())[None, :, None, :]``, a bias
    ``[:, None]``), transposes and views that split it into heads, with ``dim`` of ``node`` traced back to the
    parameter's dim; else None."""
    while True:
        if node.op == "placeholder":
            return (node, dim) if node.name in walk.fqn_of else None
        if node.op != "call_function" or len(node.all_input_nodes) != 1:
            return None
        source = node.all_input_nodes[0]
        out_val, in_val = _val(node), _val(source)
        if not (isinstance(out_val, torch.Tensor) and isinstance(in_val, torch.Tensor)):
            return None
        if node.target is aten.transpose.int:  # Inkling 2's static_weight.T.view(heads, -1, k)
            a, b = (d % in_val.dim() for d in node.args[1:3])
            node, dim = source, (b if dim == a else a if dim == b else dim)
            continue
        if node.target in (aten.t.default, aten.numpy_T.default) and in_val.dim() == 2:
            node, dim = source, 1 - dim
            continue
        if node.target is aten.permute.default:
            node, dim = source, node.args[1][dim] % in_val.dim()
            continue
        if node.target in _VIEWS:  # the input dim whose pieces the view makes this dim's
            found = [d for d in range(in_val.dim())
                     if view_placement(_sizes(in_val), _sizes(out_val), d, None, walk.tp) == (dim, None)]
            if len(found) != 1:
                return None
            node, dim = source, found[0]
            continue
        outs = [i for i, size in enumerate(out_val.shape) if not _equal(size, 1)]
        ins = [i for i, size in enumerate(in_val.shape) if not _equal(size, 1)]
        if (len(outs) != len(ins) or dim not in outs
                or not all(_equal(out_val.shape[a], in_val.shape[b]) for a, b in zip(outs, ins))):
            return None
        node, dim = source, ins[outs.index(dim)]


def _learn_pieces(walks: list, pieces: dict, notes: dict) -> bool:
    """Parameters that a pass reads only at this rank's piece, through values made from them alone (Mamba's
    ``A_log``, ``D``, its convolution's weight, ``dt_proj``'s bias added on its own): sharded where they are made
    (``pieces``: fqn -> dim), so each rank holds its piece and computes on it; the next pass walks them sharded.
    One that is read whole elsewhere becomes "used sharded in one place and whole in another" and is replicated."""
    learned = False
    for walk in walks:
        for consumer, arg in walk.gathers:  # a piece made whole again (its reader's input was whole after all)
            found = _piece_of(walk, arg, walk.shard[arg]) if arg in walk.shard else None
            fqn = walk.fqn_of[found[0].name] if found is not None else None
            if fqn in pieces and fqn not in notes:
                notes[fqn] = f"read whole by {consumer.target}{_at(consumer)}, where the value it makes meets whole ones"
                learned = True
        for _consumer, arg, dim, groups in walk.scatters:
            if groups != 1 or not isinstance(dim, int) or not walk._param_only(arg):
                continue
            found = _piece_of(walk, arg, dim)
            if found is None:
                continue
            placeholder, at = found
            fqn, size = walk.fqn_of[placeholder.name], _val(placeholder).shape[at]
            if fqn not in notes and fqn not in pieces and _ints([size]) and int(size) % walk.tp == 0:
                pieces[fqn] = at
                learned = True
    return learned


def _learn_segments(walks: list, tp: int, fused: dict, narrow: dict) -> bool:
    """Fold the cut points the walks' consumers need into ``fused`` (weight fqn -> segments); a part ``tp``
    does not divide replicates the projection (into ``narrow``). True when a segment list changed."""
    learned = False
    for walk in walks:
        for fqn, cuts in walk.wants.items():
            points = sorted(cuts)
            segments = tuple(b - a for a, b in zip(points, points[1:]))
            bad = [s for s in segments if s % tp]
            if bad:
                narrow.setdefault(fqn, f"a fused projection with a part of {bad[0]} features, which --tp {tp} "
                                       f"does not divide")
            elif fused.get(fqn) != segments:
                fused[fqn] = segments
                learned = True
    return learned


def _learn_whole_parts(walks: list, fused: dict, mixed: dict, notes: dict, narrow: dict) -> bool:
    """Fold the fused projections' parts found needed whole into ``mixed`` (a projection all of whose parts would
    be whole is replicated instead, into ``narrow``). True when a projection gained a whole part."""
    learned = False
    for walk in walks:
        for fqn, parts in walk.whole_parts.items():
            if fqn in notes or fqn not in fused:
                continue
            have = set(mixed.get(fqn, ())) | parts
            if len(have) >= len(fused[fqn]):
                narrow.setdefault(fqn, "a fused projection none of whose parts has whole heads on each rank")
            elif have != set(mixed.get(fqn, ())):
                mixed[fqn] = have
                learned = True
    return learned


def _low_rank(walk: _Walk) -> list:
    """The low-rank pairs sharded as such: per region whose column-wise linears narrow (fewer output features
    than input) and whose row-wise linear widens again, ({weight FQN: why} of its column-wise linears, the
    row-wise linears' FQNs). DeepSeek's
    MLA is one (``q_a_proj`` 7168 -> 1536, a norm, ``q_b_proj`` 1536 -> 128 heads): sharded as a pair, the wide
    output comes back whole and the attention that reads it per head runs whole; kept whole instead, the widening
    linear becomes column-wise on the heads it makes, as Megatron-Core shards MLA. A narrow MLP (a shared expert
    of 2048 under a hidden size of 7168) has the same shapes and is better sharded as a pair: :func:`settle`
    measures which."""
    def features(node):
        _x, weight, _b, out_dim = walk.forms[node]
        shape = _val(weight).shape
        return int(shape[_in_dim(_val(weight), out_dim)]), int(shape[out_dim])  # (in, out)

    out = []
    for region in _regions(walk):
        cols = [n for n in region if walk.roles.get(n) == "colwise"]
        rows = [n for n in region if walk.roles.get(n) == "rowwise"]
        if not cols or not rows:
            continue
        if (all(features(n)[1] < features(n)[0] for n in cols) and all(features(n)[1] >= features(n)[0] for n in rows)
                and any(features(n)[1] > features(n)[0] for n in rows)):  # no reader narrows again, one widens
            up = walk._param(walk.forms[rows[0]][1])
            ups = {walk._param(walk.forms[n][1]) for n in rows}
            found = {}
            for node in sorted(cols, key=lambda n: n.name):
                inp, outp = features(node)
                found[walk._param(walk.forms[node][1])] = (
                    f"a low-rank down-projection ({inp} -> {outp} features) before {up} widens again: column-wise, "
                    f"its {outp} output features all-gathered, so that {up} shards the heads it makes")
            out.append((found, ups))
    return out


def settle(graphs: list, tp: int, notes: dict, fused: dict = None, sequence=None, mixed: dict = None,
           gathered: dict = None, begins: dict = None) -> tuple:
    """:func:`_settle`, then, where it sharded low-rank pairs (:func:`_low_rank`), the same with the
    down-projections of one kind of pair gathered (the same module in every layer: ``*.self_attn.q_a_proj``):
    column-wise, with their narrow output (the latent) all-gathered, so that the norm after them and the
    up-projection read it whole; kind by kind. A change is kept where every up-projection of the kind then shards
    the heads it makes (column-wise to the end of its region): the attention that reads them runs on shards, and
    the all-reduce of the wide output is gone. (Megatron-Core keeps MLA's down-projections whole on every rank;
    gathered, each rank holds 1/tp of them and computes 1/tp of their product, for one all-gather of the latent.)
    A narrow MLP (a shared expert under a larger hidden size) has the same shapes, but its up-projection's output
    is needed whole by the residual add: it stays a row-wise pair. ``notes``, ``fused``, ``mixed`` and
    ``gathered`` (fqn -> why) end as the kept plan's."""
    from tracepp.split import blocks

    with blocks.remembered():  # every trial settles the same graphs: folded and compared once
        return _settle_trials(graphs, tp, notes, fused, sequence, mixed, gathered, begins)


def _settle_trials(graphs: list, tp: int, notes: dict, fused: dict, sequence, mixed: dict, gathered: dict,
                   begins: dict) -> tuple:
    fused = {} if fused is None else fused
    mixed = {} if mixed is None else mixed
    start = _copied((notes, fused, mixed))
    best = _settle(graphs, tp, notes, fused, sequence, mixed, begins=begins)
    kept, tried = {}, set()
    while True:  # a kept kind can turn other layers' pairs into low-rank ones (DeepSeek-V3.2): found, tried again
        kinds: dict = {}  # the pair's modules with layer numbers starred -> ({down fqn: why}, {up fqns})
        for walk in best[0]:
            for downs, ups in _low_rank(walk):
                key = tuple(plan_cost.kind_of(fqn) for fqn in downs)
                entry = kinds.setdefault(key, ({}, set()))
                entry[0].update({f: w for f, w in downs.items() if f not in notes and f not in tried})
                entry[1].update(ups)
        pending = [(downs, ups) for downs, ups in kinds.values() if downs]
        if not pending:
            break
        if len(pending) > 1:  # every kind at once first (MLA's q and kv pairs: each alone leaves the attention whole)
            pending.insert(0, ({f: w for downs, _ups in pending for f, w in downs.items()},
                               {f for _downs, ups in pending for f in ups}))
        for downs, ups in pending:
            if set(downs) <= set(kept):
                continue
            tried.update(downs)
            trial = _copied(start)
            marked = dict(kept, **downs)  # folded blocks' copies join it (a left-out block gathered as its b3)
            found = _settle(graphs, tp, *trial[:2], sequence, trial[2], marked, begins=begins)
            roles, ending = _linear_roles(found[0]), {}  # and whether an up-projection's region ends reduced
            for walk in found[0]:
                for region in _regions(walk):
                    reduced = any(walk.roles.get(n) == "rowwise" or n in walk.sums for n in region)
                    for n in region:
                        if walk.roles.get(n) == "colwise":
                            ending[walk._param(walk.forms[n][1])] = reduced
            # kept where each up-projection shards what it makes to a row-wise linear (the heads, to the output
            # projection) or a sum over its pieces (DeepSeek-V3.2's indexer: the heads' scores weighted and
            # summed), not only to be gathered again (a narrow MLP's down-projection before a residual add)
            # and where the plan then meets no more ops that need a sharded value whole (a norm's modulation MLP,
            # 64 -> 16 -> 64, has the shapes of a pair, but gathered it shards the residual stream it scales, up to
            # the router and the experts that need it whole: AXK2)
            if (all(roles.get(fqn) == "colwise" and ending.get(fqn) and fqn not in trial[0] for fqn in ups)
                    and _refusals(found) <= _refusals(best)):
                best, kept = found, marked
                for mine, theirs in zip((notes, fused, mixed), trial):
                    mine.clear()
                    mine.update(theirs)
    best = _whole_where_cheaper(graphs, tp, (notes, fused, mixed), sequence, begins, start, kept, best)
    if gathered is not None:  # those the kept plan made column-wise (an input sharded by then: row-wise)
        roles = _linear_roles(best[0])
        gathered.update({fqn: why for fqn, why in kept.items() if roles.get(fqn) == "colwise"})
    return best


def _copied(learned: tuple) -> tuple:
    """A copy of what a settle learns and updates in place (notes, fused segments, mixed parts), for a trial."""
    notes, fused, mixed = learned
    return dict(notes), dict(fused), {k: set(v) for k, v in mixed.items()}


_KIND_TRIALS = 8  # kinds of elementwise-sharded parameters tried whole one by one, at most


def _whole_where_cheaper(graphs: list, tp: int, learned: tuple, sequence, begins: dict, start: tuple, kept: dict,
                         best: tuple) -> tuple:
    """The settled plan ``best``, or a cheaper one (``split.plan_cost``: bytes moved plus FLOPs left replicated)
    with parameters it shards outside any linear kept whole. A norm's weight is sharded wherever the value it
    scales is; a walk that meets the residual stream whole beside it can shard the stream instead, and then every
    linear that reads it goes row-wise: an all-reduce of each wide MLP input where Megatron all-reduces one
    ``[b, s, h]`` (litgpt's RMSNorm, ``x * weight.float()``). Every such kind (the module with layer numbers
    starred) whole at once first, then kind by kind (``_KIND_TRIALS`` at most); a trial is kept where it costs
    less. ``learned`` (notes, fused, mixed) end as the kept plan's; each kept parameter's note says what it saved."""
    kinds = plan_cost.elementwise_kinds(best[0], _param_roles(best[0]))
    if not kinds:
        return best
    price = plan_cost.cost(best[0])
    trials = [list(kinds)] + ([[kind] for kind in kinds][:_KIND_TRIALS] if len(kinds) > 1 else [])
    chosen: dict = {}
    for trial_kinds in trials:
        if all(kind in chosen for kind in trial_kinds):
            continue
        wanted = dict(chosen, **{kind: kinds[kind] for kind in trial_kinds})
        forced = {fqn: "" for fqns in wanted.values() for fqn in fqns}
        trial = _copied(start)
        trial[0].update(forced)
        found = _settle(graphs, tp, *trial[:2], sequence, trial[2], dict(kept), begins=begins)
        found_price = plan_cost.cost(found[0])
        if found_price >= price:
            continue
        why = (f"kept whole: sharded with the value it scales, the plan cost {price:,.0f} bytes per microbatch "
               f"(collectives, and FLOPs left replicated as bytes: split/plan_cost.py); whole, {found_price:,.0f}")
        trial[0].update({fqn: why for fqn in forced})
        best, price, chosen = found, found_price, wanted
        for mine, theirs in zip(learned, trial):
            mine.clear()
            mine.update(theirs)
        if len(wanted) == len(kinds):
            break
    return best


def _param_roles(walks: list) -> dict:
    """{FQN: "colwise" | "rowwise" | "vocab"} of the weights (and column-wise biases) of the linears and embeddings
    the walks placed."""
    roles: dict = {}
    for walk in walks:
        for node, role in walk.roles.items():
            weight = node.args[0] if role == "vocab" else walk.forms[node][1]
            roles[walk._param(weight)] = role
            bias = walk.forms[node][2] if role == "colwise" else None
            if bias is not None:
                roles.setdefault(walk._param(bias), "colwise")
    return roles


def _linear_roles(walks: list) -> dict:
    """{weight FQN: "colwise" | "rowwise"} of the linears the walks placed."""
    return {walk._param(walk.forms[n][1]): r for walk in walks for n, r in walk.roles.items() if n in walk.forms}


def _refusals(settled: tuple) -> int:
    """How many ops of a settled plan's final walks (:func:`_settle`'s answer) need a sharded value whole."""
    return sum(len(walk.reasons) for walk in settled[0])


WORK = {"visits": 0}  # nodes the walks have visited (tests count the work of a plan, not its time)


def _settle(graphs: list, tp: int, notes: dict, fused: dict = None, sequence=None, mixed: dict = None,
            gathered: dict = None, begins: dict = None) -> tuple:
    """:func:`_settle_on` over the graphs with their runs of repeated blocks folded (``split.blocks``: each
    distinct block walked once; ``begins``: segment index -> the module it begins at), the walks mapped back onto
    every block; unfolded where a graph has no run, or where a run's middle is not decided as its second block."""
    from tracepp.split import blocks

    foldings = [blocks.fold(g, fqn_of, begins) if begins else None for g, fqn_of, *_rest in graphs]
    if not any(foldings):
        return _settle_on(graphs, tp, notes, fused, sequence, mixed, gathered)
    start = (dict(notes), dict(fused or {}), {k: set(v) for k, v in (mixed or {}).items()},
             dict(gathered or {}) if gathered is not None else None)
    folded_graphs = []
    for (g, fqn_of, needs_grad, *rest), folding in zip(graphs, foldings):
        if folding is None:
            folded_graphs.append((g, fqn_of, needs_grad, *rest))
            continue
        into = {original: new for new, original in folding.back.items()}
        flags = {into[node]: flag for node, flag in needs_grad.items() if node in into}
        folded_graphs.append((folding.graph, fqn_of, flags, *rest))
    walks, uses, reasons = _settle_on(folded_graphs, tp, notes, fused, sequence, mixed, gathered)
    if not all(folding is None or blocks.steady(folding, walk.shard, walk.kind, walk.segs, walk.roles)
               for walk, folding in zip(walks, foldings)):  # not a steady state: walk every block
        for mine, old in zip((notes, fused, mixed, gathered), start):
            if mine is not None:
                mine.clear()
                mine.update(old)
        return _settle_on(graphs, tp, notes, fused, sequence, mixed, gathered)
    out_walks, out_reasons = [], []
    for walk, seen, folding, (g, fqn_of, needs_grad, *_rest) in zip(walks, reasons, foldings, graphs):
        if folding is None:
            out_walks.append(walk)
            out_reasons.append(seen)
            continue
        out_walks.append(blocks.expand_object(walk, folding, {"graph": g, "fqn_of": fqn_of,
                                                                "needs_grad": needs_grad}))
        out_reasons.append(dict.fromkeys(blocks.expand_texts(list(seen), folding)))
        for learned in (notes, fused, mixed, gathered):
            if learned is not None:
                learned.update(blocks.expand_keys(learned, folding))
    uses = {}
    for walk in out_walks:
        for fqn, dims in walk.uses.items():
            uses.setdefault(fqn, set()).update(dims)
    return out_walks, uses, out_reasons


def _settle_on(graphs: list, tp: int, notes: dict, fused: dict = None, sequence=None, mixed: dict = None,
               gathered: dict = None) -> tuple:
    """Walk ``graphs`` ([(fx graph, placeholder -> FQN, node -> needs a gradient[, boundary])], stages in order;
    ``boundary``: {"outputs": value names in output order, "received": {placeholder: value name}, "last": bool})
    until every parameter has one placement: learn the segments of fused projections from the cuts of their
    outputs, replicate the parameters whose uses disagree and the column-wise linears whose output is gathered
    before the stage's end, and walk again. With ``sequence`` (the traced sequence length: sequence
    parallelism) a stage's sequence-sharded outputs arrive as sequence shards on the stages that read them.
    Returns (walks, {fqn: set of dims}, per graph the reasons met); ``notes`` (fqn -> why replicated; the forced
    set), ``fused`` (fqn -> segments) and ``mixed`` (fqn -> the parts of a fused projection computed whole: key/value
    parts with fewer heads than tp, learned where a part is needed whole) are updated."""
    fused = {} if fused is None else fused
    mixed = {} if mixed is None else mixed
    reasons = [{} for _ in graphs]  # per graph, every reason met in a pass that decided something, in order
    buffers = [{} for _ in graphs]  # per graph, values written in place where a shard cannot be: kept whole
    pieces: dict = {}  # fqn -> dim: parameters whose values are read at their piece, sharded where they are made
    from tracepp.split import blocks

    # a stage graph of the same structure as the one before it (a pipeline's middle) is walked once: its walk is
    # the one before, mapped, where it receives the same and learned the same of its parameters
    signatures = [blocks.graph_signature(g) if blocks.ENABLED else index for index, (g, *_r) in enumerate(graphs)]
    while True:
        walks, sent = [], {}
        for index, (g, fqn_of, needs_grad, *rest) in enumerate(graphs):
            boundary = rest[0] if rest else {}
            received = {ph: sent[name] for ph, name in boundary.get("received", {}).items() if name in sent}
            walk = None
            if index and signatures[index] == signatures[index - 1]:
                walk = _walk_like(walks[-1], graphs[index - 1], (g, fqn_of, needs_grad, *rest), received,
                                  (notes, fused, mixed, gathered, pieces), buffers[index - 1], buffers[index])
            if walk is None:
                walk = _Walk(g, fqn_of, tp, set(notes), needs_grad, fused, sequence, received,
                             boundary.get("last", True), mixed, buffers[index], gathered, pieces)
            outputs = list(g.output_node().args[0]) if boundary else []
            for node, name in zip(outputs, boundary.get("outputs", [])):
                if node in walk.sends:
                    sent[name] = walk.sends[node]
            walks.append(walk)
        if any(not set(walk.buffers_wanted) <= set(kept) for walk, kept in zip(walks, buffers)):
            for walk, kept in zip(walks, buffers):
                kept.update(walk.buffers_wanted)
            continue  # a value written in place must be whole from where it is made: walk again
        if _learn_pieces(walks, pieces, notes):
            continue  # a parameter read at its piece: sharded where it is made, and walk again
        narrow: dict = {}
        if _learn_segments(walks, tp, fused, narrow) and not narrow:
            continue  # the cuts were walked without their segments: walk again before deciding anything
        if _learn_whole_parts(walks, fused, mixed, notes, narrow):
            continue  # a key/value part needed whole: compute it whole, shard the rest, and walk again
        uses: dict = {}
        segments: dict = {}
        for walk, seen in zip(walks, reasons):
            seen.update(dict.fromkeys(walk.reasons))
            narrow.update(_narrow_columns(walk))
            for fqn, why in walk.unfusable.items():
                narrow.setdefault(fqn, f"a fused projection: {why}")
            for fqn, dims in walk.uses.items():
                uses.setdefault(fqn, set()).update(dims)
            for fqn, parts in walk.param_segments.items():
                segments.setdefault(fqn, set()).add(parts)
        for fqn, dims in uses.items():
            if len(dims) > 1:
                narrow.setdefault(fqn, "used sharded in one place and whole in another")
            elif len(segments.get(fqn, ())) > 1:
                narrow.setdefault(fqn, "its uses cut it into different parts")
        new = {fqn: why for fqn, why in narrow.items() if fqn not in notes}
        if not new:
            return walks, uses, reasons
        notes.update(new)


def _walk_like(walk: _Walk, before: tuple, here: tuple, received: dict, learned: tuple, buffers_before: dict,
               buffers_here: dict):
    """The walk of the graph ``here`` as the walk of ``before`` (a graph of the same structure) mapped onto it, or
    None where a walk could differ: it receives otherwise, is the last stage where the other is not, or the
    facts learned of its parameters (replicated, fused segments, whole parts, pieces, low-rank pairs) or of its
    values written in place are not the other's."""
    from tracepp.split import blocks

    g0, fqn0, _flags0, *rest0 = before
    g1, fqn1, flags1, *rest1 = here
    boundary0, boundary1 = (rest0[0] if rest0 else {}), (rest1[0] if rest1 else {})
    if boundary0.get("last", True) != boundary1.get("last", True):
        return None
    nodes, strings = blocks.graph_maps(g0, g1, fqn0, fqn1)
    if {strings.get(k, k): v for k, v in walk.received.items()} != received:
        return None
    if {strings.get(k, k): v for k, v in buffers_before.items()} != buffers_here:
        return None
    mine, theirs = set(fqn0.values()), set(fqn1.values())
    for facts in learned:
        if facts is None:
            continue
        seen = ({strings.get(k, k): blocks.rename_words(v, strings) for k, v in facts.items() if k in mine}
                if isinstance(facts, dict) else None)
        own = {k: v for k, v in facts.items() if k in theirs} if isinstance(facts, dict) else None
        if seen != own:
            return None
    if any(flags1.get(nodes[node]) != flag for node, flag in walk.needs_grad.items() if node in nodes):
        return None
    return blocks.map_object(walk, nodes, strings, {"graph": g1, "fqn_of": fqn1, "needs_grad": flags1,
                                                    "received": received})


def sequence_length(graph):
    """The traced sequence length (an int or a sympy expression): dim 1 of the first batched root input of two
    or more dims (the token ids), or None."""
    for name, ref in graph.root_inputs.items():
        if not (ref.batched and ref.meta is not None and len(ref.meta.shape) >= 2):
            continue
        for stage in graph.stages:  # a stage's placeholders: its state, then its root inputs in stage.root_inputs'
            placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]  # order (named anew: a root
            node = dict(zip(stage.root_inputs, placeholders[len(stage.state):])).get(name)  # `input` is `input_1`)
            if node is not None:
                return _sizes(_val(node))[1]
    return None


def _boundary(stage, graph) -> dict:
    nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
    first = len(stage.state) + len(stage.root_inputs)
    return {"outputs": list(stage.outputs), "last": stage.index == graph.num_stages - 1,
            "received": {nodes[first + i].name: name for i, (_producer, name) in enumerate(stage.received)}}


def plan(graph, tp: int, overrides=None, sequence_parallel: bool = False) -> tuple:
    """(TPPlan, the final walk per stage) for ``--tp tp`` (and ``--sequence-parallel``): iterate until every
    parameter has one placement."""
    from tracepp.split.cost import node_flops

    aliases = {ref.fqn: ref.aliases for ref in graph.state.values()}
    notes = _forced_by_overrides(aliases, overrides)
    sequence = sequence_length(graph) if sequence_parallel else None
    cp = (getattr(graph, "context_parallel", None) or {}).get("size", 1)
    if sequence is not None and cp > 1:  # context parallel holds 1/cp of the sequence: sp splits that further
        from torch.utils._sympy.functions import FloorDiv
        sequence = sympy.Integer(int(sequence) // cp) if sympy.sympify(sequence).is_Integer else FloorDiv(sequence, cp)
    if sequence_parallel:
        _check_sequence(sequence, tp)
    mixed: dict = {}
    gathered: dict = {}
    walks, uses, reasons = settle([(stage.graph, fqn_map(stage, graph), grad_flags(stage, graph),
                                    _boundary(stage, graph)) for stage in graph.stages], tp, notes,
                                  sequence=sequence, mixed=mixed, gathered=gathered, begins=segment_begins(graph))
    result = TPPlan(size=tp)
    if sequence_parallel:
        aliases = graph.symbol_aliases or {}
        expr = sympy.sympify(sequence)
        ours = {sym: sympy.Symbol(aliases[str(sym)]) for sym in expr.free_symbols if str(sym) in aliases}
        result.sequence_parallel = {"sequence": str(expr.xreplace(ours)), "sent": {}}
    roles = _param_roles(walks)
    segments: dict = {}
    for walk in walks:
        segments.update(walk.param_segments)
    mixed_biases = {}
    for walk in walks:
        for _node, (_x, weight, bias, _d, _segments, whole) in walk.mixed_linears.items():
            if bias is not None:
                mixed_biases[walk._param(bias)] = whole
    for fqn, dims in sorted(uses.items()):
        dim = next(iter(dims))
        entry = {"dim": dim, "role": roles.get(fqn, "elementwise") if dim is not None else "replicate"}
        if dim is not None and segments.get(fqn):
            entry["segments"] = list(segments[fqn])
        if fqn in notes:
            entry["why"] = notes[fqn]
        elif fqn in gathered:
            entry["why"] = gathered[fqn]
        elif fqn in mixed or fqn in mixed_biases:
            parts = sorted(mixed.get(fqn) or mixed_biases[fqn])
            entry["why"] = (f"a fused projection whose parts {parts} (key/value heads fewer than --tp) are computed "
                            f"whole; the other parts on this rank's heads, from its rows of this weight")
        result.params[fqn] = entry
    for pattern, how in (overrides or {}).items():
        if how == "replicate":
            continue
        for fqn, entry in result.params.items():
            if any(fnmatch.fnmatchcase(name, pattern) for name in aliases.get(fqn, [fqn])) and entry["role"] != how:
                raise ValueError(f"tp_plan[{pattern!r}] = {how!r}, but {fqn} can only be {entry['role']} in the "
                                 f"traced graph (its input is {'sharded' if entry['role'] == 'rowwise' else 'whole'}"
                                 f" there); use 'replicate' or drop the entry")
    for stage, walk, seen in zip(graph.stages, walks, reasons):
        layers = plan_cost.layer_bytes(walk)
        result.stages.append({"collectives": _collectives(walk), "replicated": list(seen)[:20],
                              "share": _share(walk, result.params, node_flops(stage.graph)),
                              "bytes": plan_cost.moved_bytes(walk),
                              "layers": {layer: list(figures) for layer, figures in layers.items()}})
        if sequence_parallel:
            for node, name in zip(stage.graph.output_node().args[0], stage.outputs):
                if node in walk.sends:
                    result.sequence_parallel["sent"][name] = walk.sends[node][0]
    return result, walks


def _check_sequence(sequence, tp: int) -> None:
    if sequence is None:
        raise ValueError("--sequence-parallel splits activations over the sequence dim, and this model has no "
                         "batched input of two or more dims (batch, sequence) to read the sequence length from: "
                         "split without --sequence-parallel")
    if sympy.sympify(sequence).is_Integer and int(sequence) % tp:
        works = [t for t in range(2, int(sequence) + 1) if int(sequence) % t == 0][:8]
        raise ValueError(f"--sequence-parallel with --tp {tp}: the traced sequence length {sequence} does not split "
                         f"into {tp} equal shards; use a sequence length that {tp} divides, or --tp in {works}")


def _share(walk: _Walk, params: dict, flops: dict) -> dict:
    """The stage's sharded share of parameters (elements) and of forward FLOPs (matmuls computed on shards)."""
    total = sharded = 0
    for node in walk.graph.nodes:
        fqn = walk.fqn_of.get(node.name) if node.op == "placeholder" else None
        if fqn is not None:
            count = _val(node).numel()
            total += count
            sharded += count if params.get(fqn, {}).get("dim") is not None else 0
    work = sum(flops.values())
    done = sum(flops.get(n.name, 0) for n in walk.graph.nodes if n in walk.shard or walk.roles.get(n) == "rowwise")
    return {"params": round(sharded / total, 4) if total else 0.0, "flops": round(done / work, 4) if work else 0.0}


def _entry(op: str, node) -> dict:
    val = _val(node)
    return {"op": op, "after": node.name, "shape": [str(s) for s in val.shape],
            "dtype": str(val.dtype).replace("torch.", "")}


def _collectives(walk: _Walk) -> list:
    """The communication the rewrite adds to one stage's forward, one line each (backward mirrors it)."""
    out = [_entry("reduce_scatter" if node in walk.reduce_scatters else "all_reduce", node)
           for node, role in walk.roles.items() if role in ("rowwise", "vocab")]
    out += [_entry("all_gather (sequence)", arg) for arg in dict.fromkeys(arg for _c, arg in walk.sp_gathers)]
    out += [_entry("all_reduce", node) for node in walk.sums]
    out += [_entry("all_gather", arg) for arg in dict.fromkeys(arg for _consumer, arg in walk.gathers)]
    reduced = walk.reduced_in_backward()  # in the order the walk met them (a set's order is the nodes' ids')
    out += [_entry("all_reduce (backward)", arg) for arg in dict.fromkeys(a for _c, a in walk.copies) if arg in reduced]
    return out


# ---- the rewrite

def _local_val(val, dim: int, tp: int):
    shape = list(val.shape)
    shape[dim] = shape[dim] // tp
    return _fake_like(val, shape)


def _fake_like(val, shape: list):
    """``val.new_empty(shape)``: a fake tensor of ``val``'s mode, dtype and device, made directly where the sizes are
    ints (a tenth of a dispatch through the fake mode; a 126-layer model's rewrite makes thousands)."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = getattr(val, "fake_mode", None)
    if isinstance(val, FakeTensor) and mode is not None and all(type(size) is int for size in shape):
        try:
            return FakeTensor(mode, torch.empty(shape, dtype=val.dtype, device="meta"), val.device)
        except TypeError:  # a torch whose FakeTensor takes other arguments
            pass
    return val.new_empty(shape)


def apply(graph, tp_plan: TPPlan, walks: list) -> None:
    """Rewrite every stage graph in place to compute on this rank's shards (the same code on every tp rank);
    a value sent as a sequence shard crosses its boundary with its local shape (1/tp of the sequence)."""
    for stage, walk in zip(graph.stages, walks):
        _rewrite(stage.graph, walk, tp_plan.size, tp_plan.params)
    for name, dim in ((tp_plan.sequence_parallel or {}).get("sent") or {}).items():
        shape = list(graph.values[name].meta.shape)
        size = shape[dim]
        shape[dim] = size // tp_plan.size if isinstance(size, int) else _floor_text(size, tp_plan.size)
        graph.values[name].meta.shape = shape


def _insert(g: fx.Graph, before, target, args, val, like) -> fx.Node:
    with g.inserting_before(before):
        node = g.call_function(target, tuple(args))
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    node.meta["val"] = val
    return node


def _after(g: fx.Graph, node, target, args, like=None, local=(None, 1)) -> fx.Node:
    """A new node right after ``node`` that its users read instead (a sum over the group, a bias added);
    ``local``: (the (dim, groups) of a reduce-scatter, tp) when the new value is this rank's sequence shard."""
    users = list(node.users)
    scatter, tp = local
    val = _val(node) if scatter is None else _local_val(_val(node), scatter[0], tp)
    new = _insert(g, node.next, target, args, val, like or node)
    for user in users:
        user.replace_input_with(node, new)
    return new


def _rewrite_mixed_linear(g: fx.Graph, node, form, tp: int) -> None:
    """``linear(x, W, b)`` of a fused projection with whole parts, as one linear per run of parts of one kind
    joined on the features: a sharded run reads ``tp_copy(x)`` and this rank's rows of its slice of W and b
    (``tp_scatter``: their gradient rows are gathered back, so W's gradient is whole on every rank); a whole run
    reads x and its rows as they are."""
    x, weight, bias, out_dim, segments, whole = form
    runs, start = [], 0
    for k, size in enumerate(segments):
        kind = k in whole
        if runs and runs[-1][0] == kind:
            runs[-1][2] += int(size)
        else:
            runs.append([kind, start, int(size)])
        start += int(size)
    copied = None
    outputs = []
    for kind, begin, length in runs:
        rows = _insert(g, node, aten.slice.Tensor, [weight, out_dim, begin, begin + length],
                       _sliced(_val(weight), out_dim, length), node)
        if out_dim == 1:  # GPT-2's Conv1D layout [in, out]: the rows of a linear are its columns
            rows = _insert(g, node, aten.t.default, [rows], _sliced(_val(weight), 0, length).t(), node)
        part_bias = None
        if bias is not None:
            part_bias = _insert(g, node, aten.slice.Tensor, [bias, 0, begin, begin + length],
                                _sliced(_val(bias), 0, length), node)
        source = x
        if not kind:
            rows = _insert(g, node, TP.tp_scatter.default, [rows, 0], _local_val(_val(rows), 0, tp), node)
            if part_bias is not None:
                part_bias = _insert(g, node, TP.tp_scatter.default, [part_bias, 0],
                                    _local_val(_val(part_bias), 0, tp), node)
            if copied is None:
                copied = _insert(g, node, TP.tp_copy.default, [x], _val(x), node)
            source = copied
        val = _val(node)
        shape = list(val.shape)
        shape[-1] = length if kind else length // tp
        outputs.append(_insert(g, node, aten.linear.default, [source, rows] + ([part_bias] if part_bias is not None
                                                                              else []), val.new_empty(shape), node))
    shape = list(_val(node).shape)
    shape[-1] = sum(int(_val(o).shape[-1]) for o in outputs)
    joined = _insert(g, node, aten.cat.default, [outputs, -1], _val(node).new_empty(shape), node)
    node.replace_all_uses_with(joined)
    g.erase_node(node)
    return joined


def _sliced(val, dim: int, length: int):
    shape = list(val.shape)
    shape[dim] = length
    return val.new_empty(shape)


def _floor_text(size: str, tp: int) -> str:
    """A boundary dim's Python expression divided by tp, as the split prints sizes (``(s_seq//2)``); the batch
    check refuses a sequence tp does not divide before any rank computes with it."""
    from torch.utils._sympy.functions import FloorDiv
    from torch.utils._sympy.printers import PythonPrinter

    return f"({PythonPrinter().doprint(FloorDiv(sympy.sympify(size), tp))})"


def _reduction(node, scatter) -> tuple:
    """(op, args) summing a partial product over the group: an all-reduce, or with sequence parallelism a
    reduce-scatter over the sequence."""
    if scatter is None:
        return TP.tp_all_reduce.default, [node]
    dim, groups = scatter
    return TP.sp_reduce_scatter.default, [node, dim] + ([groups] * (groups > 1))


def _reading(g: fx.Graph, pairs: list):
    """(key, anchor) per (consumer, value) of ``pairs``: where the collective the consumer reads the value through
    goes, and which consumers share it. Right after the value (one for all its readers), unless the value is
    written in place (a buffer a scan fills through views): then after the writes before its first reader, one for
    all; or, where a write comes after that reader too, one before each reader (each sees the writes before it, as
    in eager)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    written: dict = {}
    for node in g.nodes:
        for arg in _written(node):
            if isinstance(arg, fx.Node):
                root = _view_root(arg)
                written[root] = max(written.get(root, -1), order[node])
    first: dict = {}
    for consumer, arg in pairs:
        if consumer in order and (arg not in first or order[consumer] < order[first[arg]]):
            first[arg] = consumer

    def at(consumer, arg):
        last = written.get(_view_root(arg))  # a write into the value or anything it is a view of
        if last is None:
            return arg, (arg.next if arg.op != "placeholder" else next(n for n in g.nodes if n.op != "placeholder"))
        if last > order.get(first.get(arg), -1):
            return (arg, consumer), consumer
        return arg, first[arg]
    return at


def _rewrite(g: fx.Graph, walk: _Walk, tp: int, params: dict) -> None:
    whole: dict = {}
    for node, dim in walk.gathered_out.items():  # a gathered down-projection: every reader reads it whole
        users = list(node.users)
        whole[node] = _insert(g, node.next, TP.tp_all_gather.default, [node, dim], _val(node), node)
        for user in users:
            user.replace_input_with(node, whole[node])
    copies: dict = {}
    walk_copies = [(consumer, whole.get(arg, arg)) for consumer, arg in walk.copies]
    at = _reading(g, walk_copies)
    for consumer, arg in walk_copies:
        key, anchor = at(consumer, arg)
        if key not in copies:
            copies[key] = _insert(g, anchor, TP.tp_copy.default, [arg], _val(arg), consumer)
        consumer.replace_input_with(arg, copies[key])
    gathered: dict = {}
    made_whole: dict = {}  # (consumer, sharded input) -> the gathered value it reads (a scatter below reads that)
    walk_gathers = [(consumer, arg) for consumer, arg in walk.gathers if arg not in whole]
    at = _reading(g, walk_gathers)
    for consumer, arg in walk_gathers:
        key, anchor = at(consumer, arg)
        if key not in gathered:
            dim = walk.shard[arg]
            groups = walk.groups_of(walk.segs.get(arg)) if walk.kind.get(arg) else 1
            gathered[key] = _insert(g, anchor, TP.tp_all_gather.default, [arg, dim] + ([groups] * (groups > 1)),
                                    _val(arg), arg)
        consumer.replace_input_with(arg, gathered[key])
        made_whole[(consumer, arg)] = gathered[key]
    entering: dict = {}
    at = _reading(g, walk.sp_gathers)
    for consumer, arg in walk.sp_gathers:  # sequence shards into a column-parallel region
        key, anchor = at(consumer, arg)
        if key not in entering:
            dim, groups = walk.shard[arg], walk.groups_of(walk.segs.get(arg))
            entering[key] = _insert(g, anchor, TP.sp_all_gather.default, [arg, dim] + ([groups] * (groups > 1)),
                                    _val(arg), arg)
        consumer.replace_input_with(arg, entering[key])
    pieces: dict = {}
    walk_scatters = [(consumer, made_whole.get((consumer, arg), whole.get(arg, arg)), dim, groups)
                     for consumer, arg, dim, groups in walk.scatters]
    at = _reading(g, [(consumer, arg) for consumer, arg, _dim, _groups in walk_scatters])
    for consumer, arg, dim, groups in walk_scatters:  # a whole value read beside pieces: this rank's piece
        key, anchor = at(consumer, arg)
        if (key, dim) not in pieces:
            if isinstance(groups, tuple):  # unequal segments: this rank's piece of each
                pieces[(key, dim)] = _insert(g, anchor, TP.tp_parts.default, [arg, dim, list(groups)],
                                             _local_val(_val(arg), dim, tp), consumer)
            else:
                pieces[(key, dim)] = _insert(g, anchor, TP.tp_scatter.default,
                                             [arg, dim] + ([groups] * (groups > 1)), _local_val(_val(arg), dim, tp),
                                             consumer)
        consumer.replace_input_with(arg, pieces[(key, dim)])
    for consumer, arg, dim, count in walk.head_groups:  # whole key/value heads: the group this rank's queries need
        arg = made_whole.get((consumer, arg), whole.get(arg, arg))
        if (arg, dim, count) not in pieces:
            pieces[(arg, dim, count)] = _insert(g, consumer, TP.tp_head_group.default, [arg, dim, count],
                                                _local_val(_val(arg), dim, count), consumer)
        consumer.replace_input_with(arg, pieces[(arg, dim, count)])
    for node, role in walk.roles.items():
        scatter = walk.reduce_scatters.get(node)  # sequence parallel: (dim, groups) of the reduce-scatter
        if role == "rowwise":
            x, weight, bias, _out_dim = walk.forms[node]
            if node.target is aten.addmm.default:  # the bias is added once, after the sum
                node.target = aten.mm.default
            node.args = (weight, x) if node.args[0] is weight else (x, weight)
            reduced = _after(g, node, *_reduction(node, scatter), local=(scatter, tp))
            if bias is not None:
                if scatter is not None and walk.needs_grad.get(bias):  # each rank adds it to its own tokens
                    bias = _insert(g, reduced, TP.tp_copy.default, [bias], _val(bias), node)
                _after(g, reduced, aten.add.Tensor, [reduced, bias], node)
        elif role == "vocab":
            weight, indices = node.args[0], node.args[1]
            padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            node.target = TP.tp_vocab_embedding.default
            node.args = (weight, indices, padding) + ((False,) if scatter is not None else ())
            node.kwargs = {}
            if scatter is not None:
                _after(g, node, *_reduction(node, scatter), local=(scatter, tp))
    for node, count in walk.sums.items():  # a sum (or mean) over the sharded dim: from the partial sums
        if count is not None:
            node.target = aten.sum.dim_IntList
        reduced = _after(g, node, TP.tp_all_reduce.default, [node])
        if count is not None:
            _after(g, reduced, aten.div.Tensor, [reduced, int(count) if _ints([count]) else count], node)
    joined_from = {}  # the cat that now stands for a fused projection's linear -> that linear (its placement)
    for node, form in walk.mixed_linears.items():  # a fused projection with whole parts: one linear per run of parts
        joined_from[_rewrite_mixed_linear(g, node, form, tp)] = node
    for node, groups in walk.conv_groups.items():  # a depthwise convolution on this rank's channels
        args = list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2:] if len(node.args) < 7 else list(node.args)
        args[6] = groups
        node.args, node.kwargs = tuple(args), {k: v for k, v in node.kwargs.items() if k != "groups"}
    for node, sizes in walk.owned_splits.items():  # pieces within ranks: the owner computes each, the rest empty
        source = node.args[0]
        node.target, node.args, node.kwargs = TP.tp_owned_split.default, (
            source, walk.shard[joined_from.get(source, source)], sizes), {}
    for node, pieces in walk.cuts.items():  # cuts of the sharded dim: the local parts
        source = node.args[0]
        dim = walk.shard[joined_from.get(source, source)]
        if node.target is aten.slice.Tensor:
            (start, end), = pieces
            node.args, node.kwargs = (source, dim, start, end), {}
        elif node.target is aten.narrow.default:
            (start, end), = pieces
            node.args, node.kwargs = (source, dim, start, end - start), {}
        else:
            node.target = aten.split_with_sizes.default
            node.args, node.kwargs = (source, [end - start for start, end in pieces], dim), {}
    for node, dim in walk.shard.items():  # local sizes: in view/expand arguments and in the annotations
        if node in walk.reduce_scatters:  # its own value is the whole partial sum; the scatter after it is local
            continue
        if node.op == "placeholder" and walk._param(node) is not None:  # a parameter held as a piece: below
            continue
        if node.target in _VIEWS or node.target in _EXPANDS or node.target in _FRESH:
            sizes = list(node.args[1])
            if sizes[dim] != -1:
                sizes[dim] = sizes[dim] // tp
            node.args = (node.args[0], sizes) + tuple(node.args[2:])
        val = _val(node)
        if node in walk.mixed and isinstance(val, torch.Tensor):  # whole parts in full, the others' pieces
            shape = list(val.shape)
            shape[dim] = sum(int(p) if k in walk.mixed[node] else int(p) // tp
                             for k, p in enumerate(walk.segs[node]))
            node.meta["val"] = _fake_like(val, shape)
        elif isinstance(val, torch.Tensor):
            node.meta["val"] = _local_val(val, dim, tp)
        elif isinstance(val, (list, tuple)):
            entries = walk.items.get(node) or [(dim, None)] * len(val)
            node.meta["val"] = type(val)(_local_val(v, e[0], tp) if (e is not None and e[0] is not None) else v
                                         for v, e in zip(val, entries))
    for ph in list(g.nodes):  # a sharded parameter's annotation (and its transpose's): its local shape
        fqn = walk._param(ph) if (ph.op == "placeholder" or ph in walk.aliases) else None
        dim = params.get(fqn, {}).get("dim") if fqn is not None else None
        if dim is not None:
            ph.meta["val"] = _local_val(_val(ph), _swapped(dim, _val(ph).dim()) if ph in walk.aliases else dim, tp)
    g.lint()


# ---- what tp would change, per segment (the tuner's figures)

TUNED_SIZES = (2, 4, 8)


def whole_graph_sequence(graph: fx.Graph, root_inputs: dict):
    """The traced sequence length of the whole traced graph (as :func:`sequence_length` reads a split one): dim 1
    of the first batched root input of two or more dims, or None."""
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    for ref in root_inputs.values():
        node = placeholders.get(ref.placeholder)
        if ref.batched and node is not None and isinstance(_val(node), torch.Tensor) and _val(node).dim() >= 2:
            return _sizes(_val(node))[1]
    return None


def segment_begins(pipeline_graph) -> dict:
    """{segment index: the module it begins at} of the split's segment table (what ``split.blocks`` folds by)."""
    return {index: seg.get("begins") for index, seg in enumerate(pipeline_graph.segments or [])}


def whole_graph_walks(graph: fx.Graph, fqn_of: dict, needs_grad: dict, sizes=TUNED_SIZES, sequence=None,
                      begins: dict = None) -> dict:
    """{tp: the settled walk of the whole traced graph}: the plan ``--tp tp`` would make, seen before any cut
    (stage outputs are not gathered here). With ``sequence`` (the traced sequence length) each tp that divides
    it also gets the walk ``--sequence-parallel`` would make (``entry["sequence_parallel"]``); a walk that
    fails there leaves that tp without it."""
    out = {}
    for tp in sizes:
        walks, uses, _reasons = settle([(graph, fqn_of, needs_grad)], tp, {}, begins=begins)
        dims = {fqn: next(iter(d)) for fqn, d in uses.items()}
        out[tp] = {"walk": walks[0], "dims": dims, "attributed": set(), "needs_grad": needs_grad}
        if sequence is None or (sympy.sympify(sequence).is_Integer and int(sequence) % tp):
            continue
        try:
            walks, uses, _reasons = settle([(graph, fqn_of, needs_grad)], tp, {}, sequence=sequence, begins=begins)
        except Exception:  # an op the sequence-parallel walk does not expect: tp without it is still priced
            continue
        out[tp]["sequence_parallel"] = {"walk": walks[0], "dims": {fqn: next(iter(d)) for fqn, d in uses.items()},
                                        "attributed": set(), "needs_grad": needs_grad}
    return out


def segment_figures(nodes: list, walks: dict, flops: dict, tensor_bytes, crossing=()) -> dict:
    """Per tp size, for one segment's nodes (the tuner prices a segment at tp with these): the forward FLOPs
    computed on shards, the parameters sharded (counted at the segment of their first use), the collectives per
    microbatch: forward all-reduces (row-wise outputs, vocabulary lookups, sums over the pieces), backward
    all-reduces (gradients of the replicated inputs of sharded ops) and all-gathers, each as [count, bytes of
    the whole tensors]; and ``sharded_activation_bytes``: the activations (floating values that carry a
    gradient, as ``split.cost`` counts them) computed on shards, each rank holding 1/tp of them.

    Where the whole graph was also walked with sequence parallelism, ``["sequence_parallel"]`` holds the same
    figures for that plan plus ``sequence_activation_bytes`` (the activations sharded over the sequence:
    norms and residual adds between the regions, and the inputs of column-parallel regions, whose linears keep
    the shard for backward and gather it again there: ``runtime.tensor_parallel.shards_kept_for_backward``),
    ``reduce_scatter`` (the row-wise outputs and vocabulary
    lookups, in place of their all-reduce) and ``all_gather_sequence`` (into each column-parallel region),
    each [count, bytes of the whole tensors] (backward mirrors them: an all-gather and a reduce-scatter), and
    ``cut_sequence_bytes`` / ``cut_sequence_grad_bytes``: of the values ``crossing`` the cut before this
    segment (``split.partition.segment_table``'s), those a pipeline boundary would carry as sequence shards."""
    out = {}
    for tp, entry in walks.items():
        out[str(tp)] = _figures(nodes, entry, flops, tensor_bytes)
        if "sequence_parallel" in entry:
            out[str(tp)]["sequence_parallel"] = _figures(nodes, entry["sequence_parallel"], flops, tensor_bytes,
                                                         crossing)
    return out


def _figures(nodes: list, entry: dict, flops: dict, tensor_bytes, crossing=None) -> dict:
    """``segment_figures`` of one walk (``crossing`` given: the sequence-parallel walk, with its extra figures)."""
    walk, dims, attributed, needs_grad = entry["walk"], entry["dims"], entry["attributed"], entry["needs_grad"]
    inside = set(nodes)
    sharded_flops = sum(flops.get(n.name, 0) for n in nodes  # column-wise outputs are in walk.shard
                        if n in walk.shard or walk.roles.get(n) == "rowwise")
    params = bytes_ = 0
    for node in nodes:
        for arg in node.all_input_nodes:
            fqn = walk._param(arg) if arg.op == "placeholder" else None
            if fqn is not None and fqn not in attributed:
                attributed.add(fqn)
                if dims.get(fqn) is not None:
                    params += _val(arg).numel()
                    bytes_ += held_bytes(arg)

    def activation(node) -> bool:
        val = _val(node)
        return bool(needs_grad.get(node)) and isinstance(val, torch.Tensor) and val.dtype.is_floating_point

    def total(found) -> list:
        found = list(found)
        return [len(found), sum(tensor_bytes(_val(n)) for n in found)]

    scattered = [n for n in nodes if n in walk.reduce_scatters]
    reduce_fwd = [n for n in nodes if (walk.roles.get(n) in ("rowwise", "vocab") and n not in walk.reduce_scatters)
                  or n in walk.sums]
    copied = {arg for consumer, arg in walk.copies if consumer in inside} & walk.reduced_in_backward()
    gathered = {arg for consumer, arg in walk.gathers if consumer in inside or (consumer.op == "output"
                                                                                and arg in inside)}
    figures = {
        "sharded_flops": int(sharded_flops), "sharded_params": int(params), "sharded_param_bytes": int(bytes_),
        "all_reduce": total(reduce_fwd), "all_reduce_backward": total(copied), "all_gather": total(gathered),
        "sharded_activation_bytes": sum(tensor_bytes(_val(n)) for n in nodes
                                        if n in walk.shard and walk.kind.get(n) != "seq" and activation(n))}
    if crossing is None:
        return figures
    entering = dict.fromkeys(arg for consumer, arg in walk.sp_gathers if consumer in inside)
    sent = [n for n in crossing if walk.kind.get(n) == "seq" and n in walk.shard]
    figures.update({  # a region's input too: its linears keep the shard (gathered again in backward)
        "sequence_activation_bytes": sum(tensor_bytes(_val(n)) for n in nodes if walk.kind.get(n) == "seq"
                                         and n in walk.shard and activation(n)),
        "reduce_scatter": total(scattered), "all_gather_sequence": total(entering),
        "cut_sequence_bytes": sum(tensor_bytes(_val(n)) for n in sent),
        "cut_sequence_grad_bytes": sum(tensor_bytes(_val(n)) for n in sent if activation(n))})
    return figures
