"""Context parallelism read from the traced graph: each sample's sequence spread over ``--cp`` ranks, and the
stage graphs (and the loss) rewritten so that every rank computes its positions exactly.

Each sequence of the traced length ``S`` is cut into ``2 x cp`` chunks and cp rank ``r`` holds chunks ``r`` and
``2 x cp - 1 - r`` (``runtime/context_parallel.py``). Every value of a stage graph gets a placement: **whole**
(every cp rank holds all of it: parameters, positions, masks, rotary tables made inside ``forward``) or a
**sequence shard** on one dim (this rank's positions of ``groups`` sequences side by side; a ``[batch * seq]``
token dim has one sequence per sample). Walking each stage graph in order:

* the shards begin where the model turns token ids into activations: an ``embedding`` of a whole batched input
  with the sequence dim cuts the ids to this rank's positions (``cp_shard``), as does any floating batched input
  with the sequence dim (``inputs_embeds``) where an op that carries a gradient first reads it;
* ops that keep positions apart carry the shard: every pointwise op (``torch.Tag.pointwise``), casts, views that
  keep the sequence whole inside one dim (split into heads, merged with the batch or the features, split back;
  ``view_as_complex`` and ``view_as_real``, which regroup the last dim only), transposes, linears and matmuls over other dims, norms and softmaxes over the features, reductions over other
  dims, slices, splits and concatenations of other dims, ``repeat_interleave`` of heads, embeddings of sharded
  ids, indexing of whole tables by sharded positions (``cos[position_ids]``);
* a **whole value met beside a shard** (a rotary table, a learned position embedding's lookup, the rows of a
  causal or sliding-window mask, a target) is made whole and cut to this rank's positions (``cp_shard``), where
  the shard meets it, and the cut is moved up to the positions it was made from where it can be (so a mask is
  built for this rank's query rows only);
* **attention**: ``scaled_dot_product_attention`` (its aten form, GQA with repeated heads or ``enable_gqa``,
  MLA's), and eager ``q @ k.T -> (+ mask) -> softmax -> @ v`` (or ``baddbmm(bias, q, k.T)``, the bias cut to the
  query rows where it has them): the keys and values are all-gathered over cp in sequence order
  (``cp_all_gather``; backward reduce-scatters dK and dV), moved up past head repeats so the gather carries the
  key/value heads only; the local queries attend with the mask cut to their rows; ``is_causal`` becomes a mask
  from this rank's query positions (``cp_positions``);
* **a sum or mean over the sequence** is computed from partial sums: the local sum, ``cp_all_reduce``, divided
  by the whole count; the loss (``cross_entropy``, ``nll_loss``, ``mse_loss``..., traced from the model file's
  ``loss_fn``) with ``reduction='mean'`` becomes a sum and a count, both all-reduced, so targets with
  ``ignore_index`` spread unevenly over the ranks give eager's loss;
* inside a block of routed experts (``split.expert_parallel.find_blocks``), whose every token is computed on its
  own (dropless routing), sorting and gathering this rank's tokens is local: sizes that count tokens become local;
* anything else that mixes positions (a cumulative sum or a convolution along the sequence, a gather of
  positions, a concatenation along the sequence, an attention mask given as an input of the model) is refused by
  name, with the op and the model's source line.

A value that crosses a stage boundary as a shard is sent as it is (1/cp of the bytes; its manifest shape is the
local one). The result, :class:`CPPlan`, is plain data for the manifest; :func:`apply` rewrites the graphs.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

import tracepp.runtime.context_parallel  # noqa: F401  (registers torch.ops.tracepp.cp_*)
from tracepp.split import rules
from tracepp.split.cost import op_name
from tracepp.split.expert_parallel import GROUPED_MM
from tracepp.split.naming import frames
from tracepp.split.tensor_parallel import (_equal, _floor_text, _local_val, _val, fqn_map, grad_flags,
                                           sequence_length)
from tracepp.split.tensor_parallel import _prod as _prod_ints, _sizes as _sizes_ints


def _sizes(val) -> list:
    """A value's sizes as sympy numbers and expressions (this walk divides them)."""
    return [sympy.sympify(s) for s in _sizes_ints(val)]


def _prod(items):
    return sympy.sympify(_prod_ints(items))


aten = torch.ops.aten
CP = torch.ops.tracepp
WORK = {"visits": 0}  # nodes the walks have visited (tests count the work of a plan, not its time)



class ContextParallelError(ValueError):
    """A model ``--cp`` cannot spread: the message names the op, the model's source line and what would work."""


@dataclass
class CPPlan:
    """Plain data for the manifest: the cp size, the traced sequence length, and per stage what the rewrite
    added (cuts of whole values, key/value all-gathers with their bytes, sums over the sequence); the values
    sent as shards; the loss's sum-and-count."""

    size: int
    sequence: str  # the traced sequence length (an int or an expression over the root symbols)
    stages: list = field(default_factory=list)  # per stage: {"cut", "gathered", "reduced", "kv_bytes", ...}
    sent: dict = field(default_factory=dict)  # value name -> the dim it is sent sharded on
    outputs: list = field(default_factory=list)  # per model output leaf: [dim, groups] of its shard, or None
    loss: dict = field(default_factory=dict)  # {"reductions": [...], "cut": [...]}

    def to_json(self) -> dict:
        return {"size": self.size, "sequence": self.sequence, "order": "2cp chunks: rank r holds r and 2cp-1-r",
                "stages": self.stages, "sent": self.sent, "outputs": self.outputs, "loss": self.loss}


_TORCH_DIR = os.path.dirname(torch.__file__)


def where(node) -> str:
    """``model.py:42``: the innermost frame of the node's stack trace outside torch (the model's own line, or its
    library's, e.g. ``modeling_llama.py:123``), or ''."""
    found = frames(node.meta.get("stack_trace")) if isinstance(node, fx.Node) else []
    outside = [f for f in found if _TORCH_DIR not in f[0] and f"{os.sep}torch{os.sep}" not in f[0]]
    frame = (outside or found or [None])[-1]
    return f"{os.path.basename(frame[0])}:{frame[1]}" if frame else ""


def _at(node) -> str:
    line = where(node)
    return f" at {line}" if line else ""


def _op(node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if not isinstance(target, torch._ops.OpOverload) else \
        f"{target._schema.name.split('::')[-1]}.{target._overloadname}".replace(".default", "")


def _int(expr):
    """An int for a sympy integer (or a Python int), else None."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else None


def _arg(node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)




class _Walk:
    """One pass over one graph (a stage's, or the loss's): each value's placement and the edits."""

    def __init__(self, graph: fx.Graph, seq, cp: int, needs_grad: dict, received: dict = None,
                 expert_nodes: set = frozenset(), training: bool = True, last: bool = False, loss: bool = False,
                 fqn_of: dict = None):
        self.graph, self.seq, self.cp, self.needs_grad = graph, sympy.sympify(seq), cp, needs_grad
        self.received = received or {}
        self.expert_nodes = expert_nodes  # nodes of routed-expert blocks: token-local
        self.training, self.last, self.loss = training, last, loss
        self.fqn_of = fqn_of or {}
        self.shard: dict = {}  # node -> (dim, groups) of its sequence shard (absent: whole)
        self.items: dict = {}  # multi-output node -> per output (dim, groups) or None
        self.cuts: list = []  # (consumer, whole input, dim, groups): cut to this rank's positions
        self.gathers: list = []  # (consumer, sharded input): all-gathered over cp (keys and values)
        self.causal: list = []  # sdpa nodes with is_causal: a mask from this rank's query positions
        self.sums: dict = {}  # node -> global count (mean) or None (sum): partial sum over the sequence
        self.losses: dict = {}  # loss node -> its reduction ("mean" | "sum")
        self.sizes: list = []  # sym_size nodes of a shard's sequence dim: the local size, times cp (the whole)
        self.local_factories: dict = {}  # factory node -> (dim, groups) it is made local on (expert rows, buffers)
        self.sends: dict = {}  # sharded output -> (dim, groups)
        self.outputs: list = []  # per output: (dim, groups) or None
        self.refusals: list = []
        for node in graph.nodes:
            self._visit(node)

    # -- helpers
    def _refuse(self, node, why: str) -> bool:
        self.refusals.append(f"{node.name} ({_op(node)}){_at(node)}: {why}")
        return True  # handled (the plan raises before anything is rewritten)

    def _place(self, node, dim, groups) -> None:
        self.shard[node] = (int(dim), int(groups))

    def _global(self, node, dim):
        return _sizes(_val(node))[dim]

    def _seq_dims(self, val) -> list:
        """The dims of a whole value whose size is the sequence length (candidates for a cut)."""
        if not isinstance(val, torch.Tensor):
            return []
        return [d for d, size in enumerate(_sizes(val)) if _equal(size, self.seq)]

    def _cut(self, consumer, arg, dim, groups) -> None:
        self.cuts.append((consumer, arg, dim, groups))

    # -- the walk
    def _visit(self, node) -> None:
        WORK["visits"] += 1
        if node.op == "placeholder":
            if node.name in self.received and self.received[node.name] is not None:
                self._place(node, *self.received[node.name])
            return
        if node.op == "output":
            for arg in node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
                placed = self.shard.get(arg) if isinstance(arg, fx.Node) else None
                if placed is not None and self.last and not self.training and not self.loss:
                    self.gathers.append((node, arg))  # forward only: the model's outputs leave whole
                    placed = None
                self.outputs.append(placed)
                if placed is not None:
                    self.sends[arg] = placed
            return
        if node.op != "call_function" or node.target in rules.IGNORED:
            return
        sharded = [a for a in node.all_input_nodes if a in self.shard]
        if not sharded and node.target is operator.getitem and node.args[0] in self.items:
            sharded = [node.args[0]]  # an output of a multi-output op that holds shards
        if not sharded:
            self._seed(node)
            return
        if node in self.expert_nodes and self._token_local(node, sharded):
            return
        if not self._rule(node, sharded):
            self._refuse(node, self._why_not(node, sharded))

    def _why_not(self, node, sharded) -> str:
        held = ", ".join(f"{a.name} (positions on dim {self.shard[a][0]})" for a in sharded)
        return (f"mixes the positions of the sequence in a way context parallelism cannot split ({held} are "
                f"sequence shards): only attention may read other ranks' positions; keep this op off the "
                f"sequence dim, or split without --cp")

    def _seed(self, node) -> None:
        """Where the shards begin: an embedding of whole token ids with the sequence dim, or a floating batched
        input with it read by an op that carries a gradient."""
        target = node.target
        if target is aten.embedding.default:
            ids = node.args[1]
            dims = self._seq_dims(_val(ids))
            if dims and not self.loss:  # token ids (or positions: their lookup is cut the same way)
                self._cut(node, ids, dims[0], 1)
                self._place(node, dims[0], 1)
            return
        if self.loss or not self.needs_grad.get(node):
            return
        for arg in node.all_input_nodes:
            val = _val(arg)
            if (arg.op == "placeholder" and arg.name not in self.fqn_of and isinstance(val, torch.Tensor)
                    and val.dtype.is_floating_point and self._seq_dims(val)):
                dim = self._seq_dims(val)[0]
                self._cut(node, arg, dim, 1)
                self.shard[arg] = (dim, 1)  # read as a shard from here on (the cut is inserted before its uses)
                if not self._rule(node, [arg]):
                    self._refuse(node, self._why_not(node, [arg]))
                return

    def _rule(self, node, sharded) -> bool:
        target = node.target
        if target is operator.getitem:
            entry = self.items.get(node.args[0])
            if entry is None:
                if node.args[0] in self.shard:
                    self._place(node, *self.shard[node.args[0]])
                    return True
                return False
            placed = entry[node.args[1]] if node.args[1] < len(entry) else None
            if placed is not None:
                self._place(node, *placed)
            return True
        if target in (aten.sym_size.int,):
            dim = node.args[1] % _val(node.args[0]).dim()
            if self.shard[node.args[0]][0] == dim:
                self.sizes.append(node)
            return True
        if target in rules.KEEP or target in rules.LIKE:
            first = node.args[0]
            if first not in self.shard:
                return False
            if target is aten.type_as.default or len(sharded) == 1:
                self._place(node, *self.shard[first])
                return True
            return False
        if target in rules.SDPA:
            return self._attention(node, sharded)
        if target in rules.PRODUCTS:
            return self._matmul(node, sharded)
        if target is aten.baddbmm.default:
            return self._baddbmm(node)
        if target in rules.LOSSES:
            return self._loss(node, sharded)
        if rules.is_pointwise(target):
            return self._pointwise(node)
        if target in rules.VIEWS or target in (aten.flatten.using_ints, aten.unflatten.int):
            return self._view(node, sharded)
        if target in rules.TRANSPOSES or target in rules.COMPLEX_VIEWS or target in (
                aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.movedim.int):
            return self._move(node, sharded)
        if target in (aten.expand.default, aten.broadcast_to.default):
            return self._expand(node)
        if target is aten.expand_as.default:
            return self._expand_as(node)
        if target is aten.repeat_interleave.self_int:
            dim = _arg(node, 2, "dim")
            first = node.args[0]
            if dim is None or first not in self.shard or dim % _val(first).dim() == self.shard[first][0]:
                return False
            self._place(node, *self.shard[first])
            return True
        if target is aten.repeat.default:
            first = node.args[0]
            repeats = list(node.args[1])
            d, groups = self.shard[first]
            at = d + len(repeats) - _val(first).dim()
            if repeats[at] != 1:
                return False
            self._place(node, at, groups)
            return True
        if target in rules.SLICES or target in rules.CUTS:
            return self._slice(node, sharded)
        if target in (aten.cat.default, aten.stack.default):
            return self._cat(node, sharded)
        if target in rules.SUMS or _reduces(target):
            return self._reduce(node, sharded)
        if target in rules.NORMS:
            return self._norm(node, sharded)
        if target in rules.SOFTMAX:
            first = node.args[0]
            if sharded != [first] or node.args[1] % _val(first).dim() == self.shard[first][0]:
                return False
            self._place(node, *self.shard[first])
            return True
        if target in (aten.linear.default, aten.addmm.default):
            x = node.args[0] if target is aten.linear.default else node.args[1]
            if sharded != [x] or self.shard[x][0] == _val(x).dim() - 1:
                return False
            self._place(node, *self.shard[x])
            return True
        if target is aten.embedding.default:
            ids = node.args[1]
            if sharded != [ids]:
                return False
            self._place(node, *self.shard[ids])
            return True
        if target is aten.index.Tensor:
            return self._index(node, sharded)
        if target in rules.ALONG:
            return self._along(node, sharded)
        if target in (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default):
            return self._new_like(node)
        if target in rules.CONVOLUTIONS and node.args[0] in self.shard and self.shard[node.args[0]][0] >= 2:
            return self._refuse(node, "a convolution along the sequence dim: each position reads its neighbours, "
                                      "which other cp ranks hold (a causal convolution as in Mamba would need the "
                                      "previous chunk's last positions); keep it off the sequence, or split without "
                                      "--cp")
        return False

    def _new_like(self, node) -> bool:
        """``x.new_empty(sizes)`` of a shard, as long as the shard along its dim (a buffer the model fills with
        the shard's values: DeepSeek-V3's keys): made for this rank's positions."""
        x, sizes = node.args[0], list(node.args[1])
        dim, groups = self.shard[x]
        if len(sizes) != _val(x).dim() or not _equal(_sizes(_val(node))[dim], self._global(x, dim)):
            return False
        self.local_factories[node] = (dim, groups)
        self._place(node, dim, groups)
        return True

    # -- the rules
    def _pointwise(self, node) -> bool:
        out_val = _val(node)
        if not isinstance(out_val, torch.Tensor):
            return False
        n = out_val.dim()
        placed = None
        for arg in node.all_input_nodes:
            if arg in self.shard:
                d, groups = self.shard[arg]
                e = d + n - _val(arg).dim()
                if placed is not None and placed != (e, groups):
                    return False
                placed = (e, groups)
        e, groups = placed
        for arg in node.all_input_nodes:
            if arg in self.shard:
                continue
            val = _val(arg)
            if not isinstance(val, torch.Tensor) or val.dim() == 0:
                continue
            at = e - (n - val.dim())
            if at < 0 or _equal(val.shape[at], 1):
                continue
            if not _equal(_sizes(val)[at], _sizes(out_val)[e]):
                return False
            if arg is node.args[0] and _mutates(node.target):
                return self._refuse(node, f"writes this rank's positions into {arg.name}, which is whole: the "
                                          f"write would land in a copy; make the buffer from the sharded value "
                                          f"(x.new_empty, torch.empty_like)")
            self._cut(node, arg, at, groups)
        self._place(node, e, groups)
        return True

    def _view_dim(self, in_val, out_val, dim, groups):
        """The output dim (and its sequences) of a shard through a view, or None: the sequence must stay whole
        inside one output dim (kept, merged with the batch before it or the features after it, or split back)."""
        ins, outs = _sizes(in_val), _sizes(out_val)
        whole = ins[dim]
        outer = _prod(ins[:dim]) * groups
        inner = sympy.simplify(whole / (groups * self.seq)) * _prod(ins[dim + 1:])
        for e in range(len(outs)):
            before, after = _prod(outs[:e]), _prod(outs[e + 1:])
            g2 = sympy.simplify(outer / before)
            i2 = sympy.simplify(inner / after)
            if _int(g2) is None or _int(i2) is None or _int(g2) < 1 or _int(i2) < 1:
                continue
            if _equal(outs[e], g2 * self.seq * i2):
                return e, _int(g2)
        return None

    def _view(self, node, sharded) -> bool:
        first = node.args[0]
        if sharded != [first]:
            return False
        placed = self._view_dim(_val(first), _val(node), *self.shard[first])
        if placed is None:
            return self._refuse(node, f"reshapes the sequence dim of {first.name} ({list(_val(first).shape)} -> "
                                      f"{list(_val(node).shape)}) so that positions would not stay whole in one "
                                      f"dim: context parallelism cannot cut it")
        self._place(node, *placed)
        return True

    def _move(self, node, sharded) -> bool:
        first = node.args[0]
        if sharded != [first]:
            return False
        dim, groups = self.shard[first]
        ndim = _val(first).dim()
        target = node.target
        if target is aten.transpose.int:
            a, b = (d % ndim for d in node.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif target in (aten.t.default, aten.numpy_T.default):
            dim = ndim - 1 - dim if ndim == 2 else dim
        elif target is aten.permute.default:
            dim = [d % ndim for d in node.args[1]].index(dim)
        elif target is aten.movedim.int:
            order = list(range(ndim))
            src, dst = node.args[1] % ndim, node.args[2] % ndim
            order.insert(dst, order.pop(src))
            dim = order.index(dim)
        elif target is aten.unsqueeze.default:
            at = node.args[1] % (ndim + 1)
            dim = dim + 1 if at <= dim else dim
        elif target in rules.COMPLEX_VIEWS:  # only the last dim regrouped: (re, im) pairs <-> complex numbers
            if target is aten.view_as_complex.default and dim == ndim - 1:
                return False
        else:  # squeeze
            sizes = _sizes(_val(first))
            ats = (node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]) \
                if len(node.args) > 1 else list(range(ndim))
            ats = [a % ndim for a in ats if _equal(sizes[a % ndim], 1)]
            dim = dim - sum(1 for a in ats if a < dim)
        self._place(node, dim, groups)
        return True

    def _expand(self, node) -> bool:
        first = node.args[0]
        if first not in self.shard:
            return False
        dim, groups = self.shard[first]
        e = dim + _val(node).dim() - _val(first).dim()
        self._place(node, e, groups)
        return True

    def _expand_as(self, node) -> bool:
        """``x.expand_as(other)``: the output has ``other``'s local shape, so it holds where both are sharded on the
        same dim (aligned from the right), or ``x`` is whole with size 1 there (F.normalize's norm, ``[b, s, 1]``
        expanded to the features, keeps each position's row)."""
        first, other = node.args[0], node.args[1]
        if not isinstance(other, fx.Node) or other not in self.shard:
            return False
        dim, groups = self.shard[other]
        offset = _val(other).dim() - _val(first).dim()
        if first in self.shard:
            if self.shard[first] != (dim - offset, groups):
                return False
        elif dim - offset >= 0 and not _equal(_val(first).shape[dim - offset], 1):
            return False
        self._place(node, dim, groups)
        return True

    def _slice(self, node, sharded) -> bool:
        first = node.args[0]
        if sharded != [first]:
            return False
        dim, groups = self.shard[first]
        val = _val(first)
        ndim = val.dim()
        target = node.target
        if target in (aten.chunk.default, aten.unbind.int):
            at = _arg(node, 2 if target is aten.chunk.default else 1, "dim", 0) % ndim
        elif target is aten.select.int or target in rules.SLICES:
            at = _arg(node, 1, "dim", 0) % ndim
        else:
            at = _arg(node, 2, "dim", 0) % ndim
        if at == dim:
            if target is aten.slice.Tensor and _arg(node, 2, "start") in (None, 0) and _arg(node, 4, "step", 1) == 1:
                end = _arg(node, 3, "end")
                if end is None or (isinstance(end, int) and _int(self._global(first, dim)) is not None
                                   and end >= _int(self._global(first, dim))):
                    self._place(node, dim, groups)  # the whole dim: nothing taken
                    return True
            return self._refuse(node, f"takes part of the sequence dim of {first.name}: positions held by other "
                                      f"cp ranks; shift or trim sequences in the batch (batch(step), the target), "
                                      f"not inside the model")
        if target in rules.CUTS:
            out = _val(node)
            count = len(out) if isinstance(out, (list, tuple)) else 0
            out_dim = dim - 1 if target is aten.unbind.int and at < dim else dim
            self.items[node] = [(out_dim, groups)] * count
            return True
        self._place(node, dim - 1 if target is aten.select.int and at < dim else dim, groups)
        return True

    def _cat(self, node, sharded) -> bool:
        parts = node.args[0]
        out_val = _val(node)
        at = _arg(node, 1, "dim", 0)
        stack = node.target is aten.stack.default
        at = at % out_val.dim() if stack else at % _val(parts[0]).dim()
        placed = {self.shard[p] for p in parts if p in self.shard}
        if len(placed) != 1:
            return False
        dim, groups = next(iter(placed))
        if not stack and dim == at:
            return self._refuse(node, "joins values along the sequence dim (a prefix or another sequence): "
                                      "positions would move between cp ranks")
        for part in parts:
            if part not in self.shard:
                if not _equal(_sizes(_val(part))[dim], self._global(next(p for p in parts if p in self.shard),
                                                                      dim)):
                    return False
                self._cut(node, part, dim, groups)
        self._place(node, dim + 1 if stack and at <= dim else dim, groups)
        return True

    def _reduce(self, node, sharded) -> bool:
        first = node.args[0]
        if sharded != [first]:
            return False
        dim, groups = self.shard[first]
        val = _val(first)
        ndim = val.dim()
        target = node.target
        if target in (aten.sum.default, aten.mean.default):
            dims, keep = list(range(ndim)), False
        else:
            dims = _arg(node, 1, "dim")
            dims = list(range(ndim)) if dims is None or dims == [] else \
                [d % ndim for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
            keep = bool(_arg(node, 2, "keepdim", False))
        if dim not in dims:
            self._place(node, dim if keep else dim - sum(1 for d in dims if d < dim), groups)
            return True
        if target not in rules.SUMS:
            return self._refuse(node, f"a {_op(node)} over the sequence dim: only a sum or a mean can be "
                                      f"combined from the cp ranks' parts")
        count = _prod([_sizes(val)[d] for d in dims])
        self.sums[node] = count if target in (aten.mean.dim, aten.mean.default) else None
        return True

    def _norm(self, node, sharded) -> bool:
        x = node.args[0]
        if sharded != [x]:
            return False
        dim, groups = self.shard[x]
        if dim >= _val(x).dim() - len(node.args[1]):
            return self._refuse(node, "normalises over the sequence dim")
        if node.target is aten.native_layer_norm.default:
            self.items[node] = [(dim, groups)] * 3
        self._place(node, dim, groups)
        return True

    def _along(self, node, sharded) -> bool:
        """An op along one dim (top-k, sort, cumulative sums, gather): fine along another dim than the shard's."""
        first = node.args[0]
        if first not in self.shard:
            return False
        dim, groups = self.shard[first]
        ndim = _val(first).dim()
        target = node.target
        at = _arg(node, 2 if target is aten.topk.default else 1, "dim", -1)
        at = at % ndim
        if at == dim:
            what = {aten.cumsum.default: "a cumulative sum", aten.cumprod.default: "a cumulative product",
                    aten.gather.default: "a gather of positions"}.get(target, f"a {_op(node)}")
            return self._refuse(node, f"{what} along the sequence dim reads positions other cp ranks hold")
        if target not in (aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
                          aten.argsort.stable) and len(node.args) > 2 and isinstance(node.args[2], fx.Node):
            index = node.args[2]  # gather / scatter: the index (and a source) sharded as the input
            for other in node.args[2:4]:
                if isinstance(other, fx.Node) and _val(other).dim() and self.shard.get(other) != (dim, groups):
                    return False
        if isinstance(_val(node), (list, tuple)):
            self.items[node] = [(dim, groups)] * len(_val(node))
        else:
            self._place(node, dim, groups)
        return True

    def _index(self, node, sharded) -> bool:
        """``x[idx, ...]``: a whole table read at sharded positions (``cos[position_ids]``), or a shard indexed
        on its other dims."""
        x, indices = node.args[0], list(node.args[1])
        out_val, in_val = _val(node), _val(x)
        used = [k for k, i in enumerate(indices) if i is not None]
        if x in self.shard:
            dim, groups = self.shard[x]
            if dim in used or any(isinstance(i, fx.Node) and i in self.shard for i in indices):
                return self._refuse(node, "a gather of positions of the sequence (indexing the sequence dim): "
                                          "positions held by other cp ranks")
            e = dim if min(used) > dim else dim + out_val.dim() - in_val.dim()
            if not (0 <= e < out_val.dim()) or not _equal(_sizes(out_val)[e], _sizes(in_val)[dim]):
                return False
            self._place(node, e, groups)
            return True
        # a whole table, sharded index tensors: the output's advanced-index dims are their broadcast
        adjacent = used == list(range(used[0], used[-1] + 1))
        start = used[0] if adjacent else 0
        width = max(_val(i).dim() for i in indices if i is not None)
        placed = None
        for i in indices:
            if isinstance(i, fx.Node) and i in self.shard:
                d, groups = self.shard[i]
                e = start + d + width - _val(i).dim()
                if placed is not None and placed != (e, groups):
                    return False
                placed = (e, groups)
        e, groups = placed
        for i in indices:
            if isinstance(i, fx.Node) and i not in self.shard:
                at = e - start - (width - _val(i).dim())
                if at >= 0 and not _equal(_val(i).shape[at], 1):
                    self._cut(node, i, at, groups)
        self._place(node, e, groups)
        return True

    def _matmul(self, node, sharded, a=None, b=None) -> bool:
        """``a @ b``: a shard on a batch dim or on ``a``'s rows is carried; attention's scores (``a``'s rows and
        ``b``'s columns both positions) and ``probs @ v`` (``b``'s rows positions, ``a``'s columns whole) gather
        ``b`` over cp; both operands sharded on the contracted dim give a partial sum. ``a``, ``b``: the operands
        where they are not the node's first two arguments."""
        if a is None:
            a, b = node.args[:2]
        out_val = _val(node)
        n = out_val.dim()
        va, vb = _val(a), _val(b)
        if vb.dim() == 1 or va.dim() == 1:
            return False
        sa, sb = self.shard.get(a), self.shard.get(b)
        rows_a = sa is not None and sa[0] == va.dim() - 2
        cols_a = sa is not None and sa[0] == va.dim() - 1
        rows_b = sb is not None and sb[0] == vb.dim() - 2
        cols_b = sb is not None and sb[0] == vb.dim() - 1
        batch_a = sa is not None and sa[0] < va.dim() - 2
        batch_b = sb is not None and sb[0] < vb.dim() - 2
        if batch_a or batch_b:
            placed = None
            for arg, s, val in ((a, sa, va), (b, sb, vb)):
                if s is not None:
                    e = s[0] + n - val.dim()
                    if s[0] >= val.dim() - 2 or (placed is not None and placed != (e, s[1])):
                        return False
                    placed = (e, s[1])
            e, groups = placed
            for arg, s, val in ((a, sa, va), (b, sb, vb)):
                if s is None:
                    at = e - (n - val.dim())
                    if at >= 0 and not _equal(val.shape[at], 1):
                        self._cut(node, arg, at, groups)
            self._place(node, e, groups)
            return True
        if cols_a and rows_b:  # a sum over positions (k.T @ v): partial sums, summed over cp
            self.sums[node] = None
            return True
        if cols_a:
            return False
        if rows_a:
            if cols_b or rows_b:  # q @ k.T (scores) or probs @ v: the other operand's positions gathered
                self.gathers.append((node, b))
            self._place(node, n - 2, sa[1])
            return True
        if sa is None and cols_b:  # W @ x.T: the columns stay positions
            self._place(node, n - 1, sb[1])
            return True
        if sa is None and rows_b:  # a whole a read against the positions of b: a sum over positions
            self._cut(node, a, va.dim() - 1, sb[1])
            self.sums[node] = None
            return True
        return False

    def _baddbmm(self, node) -> bool:
        """``baddbmm(bias, a, b)``: ``a @ b`` placed as a matmul (BLOOM's attention scores, ``q @ k^T`` over heads
        merged with the batch: the keys gathered), and the bias added to its result as a pointwise operand: read at
        this rank's positions where it has a sequence dim (cut to the query rows), whole where it is per key (ALiBi's
        ``[b * heads, 1, keys]``, against the gathered keys). A product summed over positions is refused: each
        rank's part would add the bias."""
        bias, a, b = node.args[:3]
        if not self._matmul(node, [x for x in (a, b) if x in self.shard], a, b) or node not in self.shard:
            return False
        e, groups = self.shard[node]
        val = _val(bias)
        at = e - (_val(node).dim() - val.dim())
        if bias in self.shard:
            return self.shard[bias] == (at, groups)
        if at >= 0 and not _equal(val.shape[at], 1):
            if not _equal(_sizes(val)[at], self._global(node, e)):
                return False
            self._cut(node, bias, at, groups)
        return True

    def _attention(self, node, sharded) -> bool:
        q, k, v = node.args[:3]
        mask = _arg(node, 3, "attn_mask")
        if q not in self.shard or self.shard[q][0] != _val(q).dim() - 2:
            return False
        groups = self.shard[q][1]
        for kv in (k, v):
            if kv in self.shard:
                if self.shard[kv][0] != _val(kv).dim() - 2:
                    return False
                self.gathers.append((node, kv))
            elif not _equal(_sizes(_val(kv))[-2], self.seq):
                return False
        if isinstance(mask, fx.Node):
            mval = _val(mask)
            if mask in self.shard:
                if self.shard[mask][0] != mval.dim() - 2:
                    return self._refuse(node, "the mask's key dim holds only this rank's positions")
            elif not _equal(mval.shape[-2], 1):
                if not _equal(_sizes(mval)[-2], self.seq):
                    return False
                if mask.op == "placeholder" and mask.name not in self.received:
                    return self._refuse(node, f"the attention mask {mask.name} is an input of the model "
                                              f"({list(mval.shape)}): a [batch, 1, seq, seq] mask given by the "
                                              f"caller is not cut for context parallelism; pass a [batch, seq] "
                                              f"padding mask (the model builds the 4-D mask inside forward, which "
                                              f"is cut to this rank's query rows), or use is_causal")
                self._cut(node, mask, mval.dim() - 2, groups)
        if _arg(node, 5, "is_causal", False):
            self.causal.append(node)
        self._place(node, _val(node).dim() - 2, groups)
        return True

    def _loss(self, node, sharded) -> bool:
        """A loss over sharded tokens: per-token (reduction none) carries the shard; a mean becomes a sum and a
        count, a sum a partial sum, both summed over cp."""
        weight_at, reduction_at = rules.LOSSES[node.target]
        first, target = node.args[0], node.args[1]
        if first not in self.shard:
            return False
        dim, groups = self.shard[first]
        ndim = _val(first).dim()
        classes = node.target in rules.IGNORE_INDEX
        if classes and (dim == 1 and ndim > 1):
            return self._refuse(node, "the class dim of the loss is the sequence dim")
        if isinstance(target, fx.Node):
            tval = _val(target)
            t_dim = dim - (1 if classes and dim > 1 else 0) if classes else dim
            if target in self.shard:
                if self.shard[target] != (t_dim, groups):
                    return False
            else:
                if not _equal(_sizes(tval)[t_dim], self._global(first, dim)):
                    return False
                self._cut(node, target, t_dim, groups)
        if weight_at is not None and isinstance(_arg(node, weight_at, "weight"), fx.Node) and \
                _arg(node, weight_at, "weight") in self.shard:
            return False
        reduction = _arg(node, reduction_at, "reduction", 1)
        if reduction == 0:
            self._place(node, dim - (1 if classes and dim > 1 else 0) if classes else dim, groups)
            return True
        self.losses[node] = "mean" if reduction == 1 else "sum"
        return True

    def _token_local(self, node, sharded) -> bool:
        """Inside a block of routed experts every token is computed on its own: this rank sorts, counts and
        gathers its own tokens. True where handled (the op's output placed as its tokens' shard, or whole)."""
        target = node.target
        out_val = _val(node)
        if target in (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
                      aten.topk.default):
            first = node.args[0]
            if isinstance(out_val, (list, tuple)):
                self.items[node] = [self.shard[first]] * len(out_val)
            else:
                self._place(node, *self.shard[first])
            return True
        if target in (aten.histc.default, aten.bincount.default):
            return True  # this rank's counts per expert (the offsets of its own rows): whole-shaped
        if op_name(node) in GROUPED_MM:  # this rank's rows, grouped by expert with its own offsets
            rows = node.args[0]
            if rows not in self.shard:
                return False
            self._place(node, *self.shard[rows])
            return True
        if target is aten.index.Tensor:
            x, indices = node.args[0], list(node.args[1])
            for i in indices:
                if isinstance(i, fx.Node) and i in self.shard:
                    self._place(node, *self.shard[i])
                    return True
            return False
        if target in (aten.index_put_.default, aten.index_put.default):
            x, indices, values = node.args[:3]
            if x in self.shard:
                if isinstance(values, fx.Node) and values not in self.shard:
                    self._local_factory(values, x)
                self._place(node, *self.shard[x])
                return True
            return False
        return False

    def _local_factory(self, node, like) -> None:
        """A factory value (``arange`` of the rows) in an expert block, as long as a shard's dim: made local."""
        if node.op == "call_function" and node.target in rules.FACTORIES:
            self.local_factories[node] = self.shard[like]
            self._place(node, *self.shard[like])


def _mutates(target) -> bool:
    """An in-place op: it writes its first argument."""
    schema = getattr(target, "_schema", None)
    info = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return bool(info is not None and info.is_write)


def _reduces(target) -> bool:
    """A reduction over dims (``amax``, ``var``, ``logsumexp``, ``argmax``, ...), by its schema."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    name = target._schema.name.split("::")[-1]
    return name in ("amax", "amin", "argmax", "argmin", "var", "std", "logsumexp", "prod", "any", "all",
                    "linalg_vector_norm", "norm", "var_mean", "std_mean", "count_nonzero", "nansum", "nanmean")


# ---- the plan

def _expert_nodes(stage_graph: fx.Graph, fqn_of: dict) -> set:
    """The nodes of each routed-expert layer: from its token rows to the sum over the top-k experts, every node
    of the module that owns the experts' router (dropless: each token computed on its own)."""
    from tracepp.split.expert_parallel import find_blocks
    from tracepp.split.partition import node_modules

    blocks = find_blocks(stage_graph, fqn_of)
    if not blocks:
        return set()
    owners = set()
    for block in blocks:
        owner = block.name.rsplit(".", 1)[0] if "." in block.name else block.name
        owners.add(owner)
    found = set()
    for node in stage_graph.nodes:
        paths = [p for p in node_modules(node) if p]
        if any(p == o or p.startswith(o + ".") for p in paths for o in owners):
            found.add(node)
    return found


def plan(graph, cp: int, loss=None, training: bool = True) -> tuple:
    """(CPPlan, the walk per stage, the loss's walk or None) for ``--cp cp``. ``loss``: the traced loss
    (:class:`LossGraph`), walked with the last stage's output placements."""
    seq = sequence_length(graph)
    _check_sequence(seq, cp)
    aliases = graph.symbol_aliases or {}
    expr = sympy.sympify(seq)
    ours = {sym: sympy.Symbol(aliases[str(sym)]) for sym in expr.free_symbols if str(sym) in aliases}
    result = CPPlan(size=cp, sequence=str(expr.xreplace(ours)))
    from tracepp.split import blocks
    from tracepp.split.tensor_parallel import segment_begins

    walks, sent = [], {}
    begins = segment_begins(graph)
    for stage in graph.stages:
        nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
        first = len(stage.state) + len(stage.root_inputs)
        received = {nodes[first + i].name: sent.get(name) for i, (_producer, name) in enumerate(stage.received)}
        fqn_of = fqn_map(stage, graph)
        flags = grad_flags(stage, graph)
        experts = _expert_nodes(stage.graph, fqn_of)
        last = stage.index == graph.num_stages - 1

        def build(g, into, flags=flags, experts=experts, received=received, last=last, fqn_of=fqn_of):
            mapped = {into(n): f for n, f in flags.items() if into(n) is not None}
            return _Walk(g, seq, cp, mapped, received, {into(n) for n in experts} - {None}, training, last,
                         fqn_of=fqn_of)

        walk = blocks.walk_once(stage.graph, fqn_of, begins, build,
                                lambda w: (w.shard, w.items, w.sums, w.local_factories),
                                {"graph": stage.graph, "needs_grad": flags, "fqn_of": fqn_of,
                                 "expert_nodes": experts, "received": received})
        outputs = list(stage.graph.output_node().args[0])
        for node, name in zip(outputs, stage.outputs):
            if isinstance(node, fx.Node) and node in walk.sends:
                sent[name] = walk.sends[node]
        walks.append(walk)
    loss_walk = None
    last = walks[-1]
    result.outputs = [list(p) if p is not None else None for p in last.outputs]
    if loss is not None:
        loss_seq = loss.sequence(result.outputs)
        received = {name: (tuple(result.outputs[i]) if i is not None and result.outputs[i] else None)
                    for name, i in loss.inputs.items()}
        loss_walk = _Walk(loss.graph, loss_seq, cp, {}, received, training=True, loss=True)
        ends = loss_walk.outputs
        if any(p is not None for p in ends):
            loss_walk.refusals.append("the loss function returns values that still hold only this rank's positions "
                                      "(a per-token loss): reduce it over the tokens (mean or sum) in loss_fn")
    refusals = [text for walk in walks + ([loss_walk] if loss_walk else []) for text in walk.refusals]
    if not any(walk.shard for walk in walks[:1]):
        refusals.append("no value of the first stage holds a sequence shard: --cp starts at an embedding of "
                        "token ids with the sequence dim (or a floating input with it, read by an op that "
                        "carries a gradient); the model has none")
    if refusals:
        more = f" (and {len(refusals) - 8} more)" if len(refusals) > 8 else ""
        raise ContextParallelError(f"--cp {cp} cannot spread this model's sequence over its ranks:\n  "
                                   + "\n  ".join(refusals[:8]) + more)
    for stage, walk in zip(graph.stages, walks):
        result.stages.append(_stage_record(walk))
        for node, name in zip(stage.graph.output_node().args[0], stage.outputs):
            if isinstance(node, fx.Node) and node in walk.sends and stage.index < graph.num_stages - 1:
                result.sent[name] = walk.sends[node][0]
    if loss_walk is not None:
        result.loss = {"reductions": [{"op": _op(n), "reduction": how, "line": where(n)}
                                      for n, how in loss_walk.losses.items()]
                       + [{"op": _op(n), "reduction": "sum" if c is None else "mean", "line": where(n)}
                          for n, c in loss_walk.sums.items()],
                       "cut": sorted({a.name for _c, a, _d, _g in loss_walk.cuts})}
    return result, walks, loss_walk


def _check_sequence(seq, cp: int) -> None:
    if seq is None:
        raise ContextParallelError("--cp spreads each sample's sequence over its ranks, and this model has no "
                                   "batched input of two or more dims (batch, sequence) to read the sequence "
                                   "length from: split without --cp")
    length = _int(seq)
    if length is not None and length % (2 * cp):
        works = [c for c in range(2, length // 2 + 1) if length % (2 * c) == 0][:8]
        raise ContextParallelError(
            f"--cp {cp}: the traced sequence length {length} does not cut into 2 x cp = {2 * cp} equal chunks "
            f"(rank r holds chunks r and {2 * cp - 1}-r); use a sequence length that {2 * cp} divides, or --cp in "
            f"{works or '[none: the sequence is too short]'}")


def _bytes(val) -> int:
    from tracepp.split.cost import tensor_bytes

    return int(tensor_bytes(val))


def _stage_record(walk: _Walk) -> dict:
    return {
        "reduced": [{"op": _op(n), "line": where(n)} for n in walk.sums],
        "causal": len(walk.causal),
        "sharded_values": sum(1 for n in walk.shard if n.op != "placeholder"),
    }


def _exchange(g: fx.Graph, cp: int) -> dict:
    """What a rewritten stage graph holds of context parallelism: the values cut to this rank's positions (by
    the value they cut, after the cuts moved up to the positions) and its key/value all-gathers, each with its
    whole shape; ``kv_bytes``: the whole keys and values gathered per microbatch forward (each rank receives
    (cp - 1) / cp of them, and as many go back as dK/dV in backward's reduce-scatter)."""
    cut, gathered, positions = [], [], 0
    for node in g.nodes:
        if node.op != "call_function":
            continue
        if node.target is CP.cp_shard.default:
            cut.append(node.args[0].name)
        elif node.target is CP.cp_positions.default:
            positions += 1
        elif node.target is CP.cp_all_gather.default:
            val = _val(node)
            repeats = node.args[3] if len(node.args) > 3 else 1  # heads repeated after the exchange
            shape = list(val.shape)
            if repeats > 1:
                shape[node.args[4]] = shape[node.args[4]] // repeats
            gathered.append({"value": node.args[0].name, "shape": [str(s) for s in shape],
                             "dtype": str(val.dtype).replace("torch.", ""), "bytes": _bytes(val) // repeats,
                             "repeats": repeats, "line": where(node)})
    return {"cut": cut, "positions": positions, "gathered": gathered,
            "kv_bytes": sum(item["bytes"] for item in gathered),
            "kv_received_bytes_per_rank": sum(item["bytes"] for item in gathered) * (cp - 1) // cp}


# ---- the rewrite

def _insert(g: fx.Graph, before, target, args, val, like, kwargs=None) -> fx.Node:
    with g.inserting_before(before):
        node = g.call_function(target, tuple(args), kwargs or {})
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                   "source_fn_stack")})
    node.meta["val"] = val
    return node


def _anchor(g: fx.Graph, arg, consumers) -> fx.Node:
    """Where a collective or a cut of ``arg`` goes: right before its first consumer, after anything the graph
    writes into ``arg`` in place (DeepSeek-V3 fills its keys through slices of a new buffer)."""
    order = {node: i for i, node in enumerate(g.nodes)}
    return min(consumers, key=order.__getitem__)


def apply(graph, cp_plan: CPPlan, walks: list, loss=None, loss_walk=None) -> None:
    """Rewrite every stage graph (and the loss's) in place to compute this rank's positions; a value sent as a
    shard crosses its boundary with its local shape (1/cp of the sequence)."""
    cp = cp_plan.size
    for stage, walk, record in zip(graph.stages, walks, cp_plan.stages):
        _rewrite(stage.graph, walk, cp)
        record.update(_exchange(stage.graph, cp))
    if loss is not None and loss_walk is not None:
        _rewrite(loss.graph, loss_walk, cp)
    for name, dim in cp_plan.sent.items():
        shape = list(graph.values[name].meta.shape)
        size = shape[dim]
        shape[dim] = size // cp if isinstance(size, int) else _floor_text(size, cp)
        graph.values[name].meta.shape = shape


def _local_size(g: fx.Graph, size, cp: int, user):
    """A size argument of a view or expand made local: an int divided, a symbolic size (a graph node) divided
    by a node before ``user``."""
    if isinstance(size, int):
        return size if size == -1 else size // cp
    if isinstance(size, fx.Node):
        with g.inserting_before(user):
            node = g.call_function(operator.floordiv, (size, cp))
        val = _val(size)
        node.meta["val"] = val // cp if val is not None else None
        return node
    return size


def _rewrite(g: fx.Graph, walk: _Walk, cp: int) -> None:
    cut: dict = {}
    firsts: dict = {}
    for consumer, arg, dim, groups in walk.cuts:
        firsts.setdefault((arg, dim, groups), []).append(consumer)
    for consumer, arg, dim, groups in walk.cuts:
        key = (arg, dim, groups)
        if key not in cut:
            cut[key] = _insert(g, _anchor(g, arg, firsts[key]), CP.cp_shard.default,
                               [arg, dim] + ([groups] * (groups > 1)), _local_val(_val(arg), dim, cp), consumer)
        consumer.replace_input_with(arg, cut[key])
        if arg.op == "placeholder" and arg in walk.shard:  # a floating input read as a shard from here on
            for user in list(arg.users):
                if user is not cut[key] and user.op != "output":
                    user.replace_input_with(arg, cut[key])
    gathered: dict = {}
    for consumer, arg in walk.gathers:
        if arg not in gathered:
            dim, groups = walk.shard[arg]
            consumers = [c for c, a in walk.gathers if a is arg]
            gathered[arg] = _insert(g, _anchor(g, arg, consumers), CP.cp_all_gather.default,
                                    [arg, dim] + ([groups] * (groups > 1)), _val(arg), arg)
        consumer.replace_input_with(arg, gathered[arg])
    for node in walk.causal:
        _causal_mask(g, node, walk, cp)
    for node, count in walk.sums.items():
        if node.target is aten.mean.dim:
            node.target = aten.sum.dim_IntList
        elif node.target is aten.mean.default:
            node.target = aten.sum.default
        reduced = _after(g, node, CP.cp_all_reduce.default, [node])
        if count is not None:
            _after(g, reduced, aten.div.Tensor, [reduced, int(count) if count.is_Integer else count], node)
    for node, how in walk.losses.items():
        _loss_sum(g, node, how)
    for node in walk.sizes:  # the size of a shard's sequence dim, read inside the graph: the whole length
        _after(g, node, operator.mul, [node, cp], node)
    for node, (dim, _groups) in walk.local_factories.items():  # made for this rank's positions
        args = list(node.args)
        if node.target is aten.arange.default:
            args[0] = _local_size(g, args[0], cp, node)
        else:
            at = 1 if node.target in (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
                                      aten.new_full.default) else 0
            sizes = list(args[at])
            sizes[dim] = _local_size(g, sizes[dim], cp, node)
            args[at] = sizes
        node.args = tuple(args)
    for node, (dim, _groups) in list(walk.shard.items()):  # local sizes: view/expand arguments, annotations
        if node.op == "placeholder" and node.name not in walk.received:
            continue  # a floating input cut at its first use: the input itself stays whole
        if node.target in rules.VIEWS or node.target in (aten.expand.default, aten.broadcast_to.default):
            sizes = list(node.args[1])
            sizes[dim] = _local_size(g, sizes[dim], cp, node)
            node.args = (node.args[0], sizes) + tuple(node.args[2:])
        elif node.target is aten.unflatten.int:  # (x, dim, sizes): the sizes the unflattened dim becomes
            start, sizes = node.args[1] % len(_val(node).shape), list(node.args[2])
            if start <= dim < start + len(sizes):
                sizes[dim - start] = _local_size(g, sizes[dim - start], cp, node)
                node.args = (node.args[0], node.args[1], sizes)
        val = _val(node)
        if isinstance(val, torch.Tensor):
            node.meta["val"] = _local_val(val, dim, cp)
    for node, entries in walk.items.items():
        val = _val(node)
        if isinstance(val, (list, tuple)):
            node.meta["val"] = type(val)(_local_val(v, e[0], cp) if e is not None and isinstance(v, torch.Tensor)
                                         else v for v, e in zip(val, entries))
    _Hoist(g, walk, cp).run()
    g.lint()


_GATHER_THROUGH = {  # ops between a shard and its key/value gather that only repeat or regroup heads
    aten.repeat_interleave.self_int, aten.expand.default, aten.unsqueeze.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.transpose.int, aten.permute.default,
}
_CUT_UNARY = {aten.alias.default, aten.clone.default, aten.contiguous.default, aten.detach.default,
              aten.lift_fresh_copy.default}


class _Hoist:
    """After the rewrite: each key/value all-gather moved up past the ops that only repeat heads (GQA's
    ``repeat_kv``, ``repeat_interleave``), so it carries the key/value heads; each cut of a whole value moved up
    to the positions it was made from (a rotary table's ``arange``, a mask's query positions: ``cp_positions``),
    so the value is made for this rank's positions only and never whole."""

    def __init__(self, g: fx.Graph, walk: _Walk, cp: int):
        self.g, self.walk, self.cp = g, walk, cp
        self.memo: dict = {}
        self.like = None

    def run(self) -> None:
        for node in list(self.g.nodes):
            if node.op == "call_function" and node.target is CP.cp_all_gather.default:
                self._gather(node)
        for node in list(self.g.nodes):
            if node.op == "call_function" and node.target is CP.cp_shard.default and node.args[0].op != "placeholder":
                x, dim = node.args[0], node.args[1]
                groups = node.args[2] if len(node.args) > 2 else 1
                self.like = node  # a cut that moves up to an input keeps the line of the use it serves
                made = self._cut_of(x, dim, groups, node)
                if made is not node:
                    node.replace_all_uses_with(made)
                    self.g.erase_node(node)
        changed = True
        while changed:  # a metadata check alone keeps a whole value alive: both go, then what only they read
            changed = False
            for node in list(self.g.nodes):
                if node.op == "call_function" and node.target in rules.IGNORED and len(node.args[0].users) == 1:
                    self.g.erase_node(node)
                    changed = True
            changed = self.g.eliminate_dead_code() or changed

    # -- gathers
    def _gather(self, gather) -> None:
        while True:
            if self._repeat_heads(gather):
                return
            x = gather.args[0]
            if x.op != "call_function" or x.target not in _GATHER_THROUGH or len(x.users) != 1:
                return
            y = x.args[0]
            if not isinstance(y, fx.Node) or y not in self.walk.shard:
                return
            dim, groups = self.walk.shard[y]
            with self.g.inserting_before(x):
                moved = self.g.call_function(CP.cp_all_gather.default, (y, dim) + ((groups,) if groups > 1 else ()))
            moved.meta.update({k: v for k, v in gather.meta.items() if k != "val"})
            local = _val(y)
            shape = list(local.shape)
            shape[dim] = shape[dim] * self.cp
            moved.meta["val"] = local.new_empty(shape)
            x.replace_input_with(y, moved)
            self._whole_sizes(x)
            x.meta["val"] = _val(gather)
            gather.replace_all_uses_with(x)
            self.g.erase_node(gather)
            gather = moved

    def _repeat_heads(self, gather) -> bool:
        """A gather of heads repeated for grouped-query attention (``repeat_interleave(n, dim=h)``, or
        ``repeat_kv``'s ``unsqueeze -> expand -> reshape``): one gather of the key/value heads that repeats them
        after the exchange (its ``repeats`` and ``head_dim``), so the bytes moved and the shard backward keeps are
        the key/value heads'. True where it took the repeat in."""
        x = gather.args[0]
        if len(gather.args) > 3 or x.op != "call_function" or len(x.users) != 1:
            return False
        if x.target is aten.repeat_interleave.self_int:
            source, repeats = x.args[0], x.args[1]
            head = _arg(x, 2, "dim")
            if not isinstance(repeats, int) or head is None or source not in self.walk.shard:
                return False
            head %= _val(source).dim()
            chain = [x]
        elif x.target in rules.VIEWS and isinstance(x.args[0], fx.Node) and x.args[0].target is aten.expand.default \
                and len(x.args[0].users) == 1 and isinstance(x.args[0].args[0], fx.Node) \
                and x.args[0].args[0].target is aten.unsqueeze.default and len(x.args[0].args[0].users) == 1:
            expand, unsqueeze = x.args[0], x.args[0].args[0]
            source = unsqueeze.args[0]
            if source not in self.walk.shard:
                return False
            ndim = _val(source).dim()
            at = unsqueeze.args[1] % (ndim + 1)
            head = at - 1
            repeats = _val(expand).shape[at]
            merged = list(_val(source).shape)
            if head < 0 or not isinstance(repeats, int) or head == self.walk.shard[source][0]:
                return False
            merged[head] = merged[head] * repeats
            out = list(_val(x).shape)  # this rank's shape (the rewrite made it local)
            if len(out) != ndim or any(not _equal(a, b) for a, b in zip(out, merged)):
                return False
            chain = [x, expand, unsqueeze]
        else:
            return False
        dim, groups = self.walk.shard[source]
        if head == dim:
            return False
        with self.g.inserting_before(gather):
            fused = self.g.call_function(CP.cp_all_gather.default, (source, dim, groups, repeats, head))
        fused.meta.update({k: v for k, v in gather.meta.items()})
        gather.replace_all_uses_with(fused)
        self.g.erase_node(gather)
        for node in chain:
            if not node.users:
                self.g.erase_node(node)
        return True

    def _whole_sizes(self, node) -> None:
        """A view's or expand's size list back to the whole sequence (it now runs after the gather)."""
        if node.target not in rules.VIEWS and node.target is not aten.expand.default:
            return
        dim = self.walk.shard[node][0]
        sizes = list(node.args[1])
        size = sizes[dim]
        if isinstance(size, int) and size != -1:
            sizes[dim] = size * self.cp
        elif isinstance(size, fx.Node) and size.target is operator.floordiv:
            sizes[dim] = size.args[0]
        node.args = (node.args[0], sizes) + tuple(node.args[2:])

    # -- cuts
    def _cut_of(self, x, dim: int, groups: int, existing=None):
        """A node computing this rank's positions of the whole value ``x`` on ``dim``: made from cut inputs where
        ``x`` is computed position by position, else a ``cp_shard`` of ``x`` (``existing`` where given)."""
        key = (x, dim, groups)
        if key in self.memo:
            return self.memo[key]
        made = self._push(x, dim, groups)
        if made is None:
            if existing is None:
                with self.g.inserting_after(x if x.op != "placeholder" else _last_placeholder(self.g)):
                    existing = self.g.call_function(CP.cp_shard.default,
                                                    (x, dim) + ((groups,) if groups > 1 else ()))
                source = x if x.meta.get("stack_trace") or self.like is None else self.like
                existing.meta.update({k: v for k, v in source.meta.items() if k in ("stack_trace", "nn_module_stack")})
                existing.meta["val"] = _local_val(_val(x), dim, self.cp)
            made = existing
        self.memo[key] = made
        if not hasattr(self.walk, "made_for"):
            self.walk.made_for = {}
        self.walk.made_for[made] = key  # what it computes, for the verifier (``split/verify_cp.py``)
        return made

    def _new(self, like, target, args, kwargs=None, val=None, dim=None):
        with self.g.inserting_after(like):
            node = self.g.call_function(target, tuple(args), dict(kwargs if kwargs is not None else like.kwargs))
        node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                      "source_fn_stack")})
        node.meta["val"] = val if val is not None else _local_val(_val(like), dim, self.cp)
        return node

    def _push(self, x, dim: int, groups: int):
        if x.op != "call_function" or not isinstance(_val(x), torch.Tensor):
            return None
        target = x.target
        val = _val(x)
        whole = _sizes(val)[dim]
        if target in rules.ARANGES:
            return self._arange(x) if dim == 0 and groups == 1 else None
        if target in rules.FACTORIES and target is not aten.scalar_tensor.default:
            at = 1 if target in (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
                                 aten.new_full.default) else 0
            sizes = list(x.args[at])
            if dim >= len(sizes):
                return None
            sizes[dim] = _local_size(self.g, sizes[dim], self.cp, x)
            args = list(x.args)
            args[at] = sizes
            return self._new(x, target, args, dim=dim)
        if rules.is_pointwise(target) or target in rules.KEEP or target in rules.LIKE or target in _CUT_UNARY:
            if _mutates(target):
                return None
            n = val.dim()
            args = []
            for arg in x.args:
                if isinstance(arg, fx.Node) and isinstance(_val(arg), torch.Tensor) and _val(arg).dim():
                    at = dim - (n - _val(arg).dim())
                    if at >= 0 and not _equal(_val(arg).shape[at], 1):
                        if not _equal(_sizes(_val(arg))[at], whole):
                            return None
                        arg = self._cut_of(arg, at, groups)
                args.append(arg)
            return self._new(x, target, args, dim=dim)
        if target is aten.unsqueeze.default:
            at = x.args[1] % val.dim()
            if at == dim:
                return None
            source = self._cut_of(x.args[0], dim - 1 if at < dim else dim, groups)
            return self._new(x, target, [source, x.args[1]], dim=dim)
        if target in (aten.transpose.int, aten.permute.default, aten.t.default):
            ndim = val.dim()
            if target is aten.permute.default:
                source_dim = [d % ndim for d in x.args[1]][dim]
            elif target is aten.transpose.int:
                a, b = (d % ndim for d in x.args[1:3])
                source_dim = b if dim == a else a if dim == b else dim
            else:
                source_dim = ndim - 1 - dim if ndim == 2 else dim
            source = self._cut_of(x.args[0], source_dim, groups)
            return self._new(x, target, [source] + list(x.args[1:]), dim=dim)
        if target in rules.VIEWS or target is aten.expand.default:
            source = x.args[0]
            sval = _val(source)
            if target is aten.expand.default:
                at = dim - (val.dim() - sval.dim())
                placed = (at, groups) if at >= 0 else None
                if placed is not None and _equal(sval.shape[at], 1):
                    placed = None  # expanded along the sequence: nothing to cut in the source
            else:
                placed = self.walk._view_dim(val, sval, dim, groups)
                if placed is None:
                    return None
            if placed is not None:
                source = self._cut_of(source, *placed)
            sizes = list(x.args[1])
            sizes[dim] = _local_size(self.g, sizes[dim], self.cp, x)
            return self._new(x, target, [source, sizes] + list(x.args[2:]), dim=dim)
        if target is aten.cat.default:
            at = (x.args[1] if len(x.args) > 1 else 0) % val.dim()
            if at == dim:
                return None
            parts = [self._cut_of(part, dim, groups) for part in x.args[0]]
            return self._new(x, target, [parts] + list(x.args[1:]), dim=dim)
        if target is aten.embedding.default:
            ids = x.args[1]
            if dim >= _val(ids).dim():
                return None
            return self._new(x, target, [x.args[0], self._cut_of(ids, dim, groups)] + list(x.args[2:]), dim=dim)
        if target is aten.outer.default and groups == 1:
            args = list(x.args)
            args[dim] = self._cut_of(args[dim], 0, 1)
            return self._new(x, target, args, dim=dim)
        if target in rules.PRODUCTS:
            a, b = x.args[:2]
            va, vb = _val(a), _val(b)
            if va.dim() < 2 or vb.dim() < 2:
                return None
            n = val.dim()
            if dim == n - 2:
                args = [self._cut_of(a, va.dim() - 2, groups), b]
            elif dim == n - 1:
                args = [a, self._cut_of(b, vb.dim() - 1, groups)]
            else:
                args = []
                for arg, v in ((a, va), (b, vb)):
                    at = dim - (n - v.dim())
                    args.append(self._cut_of(arg, at, groups) if at >= 0 and not _equal(v.shape[at], 1) else arg)
            return self._new(x, target, args, dim=dim)
        if target is aten.index.Tensor:
            return self._index(x, dim, groups)
        return None

    def _arange(self, x):
        """``arange(start, end, step)`` at this rank's positions: ``start + step * cp_positions(length)``, cast to
        its dtype (nanoGPT's ``torch.arange(0, t, dtype=torch.long)``); None where start or step is not an int."""
        args = list(x.args)
        start, end, step = (0, args[0], 1) if x.target is aten.arange.default else \
            (args[0], args[1], args[2] if len(args) > 2 else 1)
        if not isinstance(start, int) or not isinstance(step, int):
            return None
        length = end if (start, step) == (0, 1) else _int(_sizes(_val(x))[0])
        if not isinstance(length, (int, fx.Node)):
            return None
        local = _local_val(_val(x), 0, self.cp)
        positions = local.new_empty(local.shape, dtype=torch.int64)
        made = self._new(x, CP.cp_positions.default, [length], {"device": x.kwargs.get("device")}, val=positions)
        if step != 1:
            made = self._new(made, aten.mul.Tensor, [made, step], {}, val=positions)
        if start != 0:
            made = self._new(made, aten.add.Tensor, [made, start], {}, val=positions)
        if local.dtype is not torch.int64:
            made = self._new(made, aten._to_copy.default, [made], {"dtype": local.dtype}, val=local)
        return made

    def _index(self, x, dim: int, groups: int):
        source, indices = x.args[0], list(x.args[1])
        used = [k for k, i in enumerate(indices) if i is not None]
        if not used or used != list(range(len(used))):
            return None  # only indices on the leading dims (the output: their broadcast, then the rest)
        width = max(_val(i).dim() for i in indices if i is not None)
        if dim < width:
            new = []
            for i in indices:
                if isinstance(i, fx.Node) and _val(i).dim():
                    at = dim - (width - _val(i).dim())
                    if at >= 0 and not _equal(_val(i).shape[at], 1):
                        i = self._cut_of(i, at, groups)
                new.append(i)
            return self._new(x, x.target, [source, new], dim=dim)
        source = self._cut_of(source, dim - width + len(used), groups)
        return self._new(x, x.target, [source, indices], dim=dim)


def _last_placeholder(g: fx.Graph):
    return [n for n in g.nodes if n.op == "placeholder"][-1]


def _after(g: fx.Graph, node, target, args, like=None) -> fx.Node:
    users = list(node.users)
    val = _val(node)
    new = _insert(g, node.next, target, args, val, like or node)
    if target is operator.mul and isinstance(val, torch.SymInt):
        new.meta["val"] = val * args[1]
    for user in users:
        user.replace_input_with(node, new)
    return new


def _causal_mask(g: fx.Graph, node, walk: _Walk, cp: int) -> None:
    """``is_causal`` of the local queries against the whole keys: query position >= key position, with this
    rank's query positions (``cp_positions``) and every key position (``arange``)."""
    q, k = node.args[0], node.args[1]
    length = _sizes(_val(k))[-2]
    size = int(length) if length.is_Integer else _symbol_node(g, walk.seq, node)
    device = _val(q).device
    with g.inserting_before(node):
        rows = g.call_function(CP.cp_positions.default, (size,), {"device": device})
        keys = g.call_function(aten.arange.default, (size,), {"device": device})
        column = g.call_function(aten.unsqueeze.default, (rows, -1))
        mask = g.call_function(aten.ge.Tensor, (column, keys))
    for new in (rows, keys, column, mask):
        new.meta.update({k2: v for k2, v in node.meta.items() if k2 in ("stack_trace", "nn_module_stack")})
    fake = _val(q)
    local, whole = _val(q).shape[-2] // cp, _val(k).shape[-2]  # q's annotation is made local after this
    rows.meta["val"] = fake.new_empty([local], dtype=torch.int64)
    keys.meta["val"] = fake.new_empty([whole], dtype=torch.int64)
    column.meta["val"] = fake.new_empty([local, 1], dtype=torch.int64)
    mask.meta["val"] = fake.new_empty([local, whole], dtype=torch.bool)
    args = list(node.args)
    kwargs = dict(node.kwargs)
    if len(args) > 5:
        args[5] = False
    kwargs.pop("is_causal", None)
    if len(args) > 3:
        args[3] = mask
    else:
        kwargs["attn_mask"] = mask
    node.args, node.kwargs = tuple(args), kwargs


def _symbol_node(g: fx.Graph, seq, before) -> fx.Node:
    """The graph node holding the sequence length (a placeholder size or a sym_size), for a symbolic one."""
    for node in g.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and _equal(val.node.expr, seq) and node.op in ("placeholder",
                                                                                         "call_function"):
            return node
    raise ContextParallelError(f"no value of the graph holds the sequence length {seq}")


def _loss_sum(g: fx.Graph, node, how: str) -> None:
    """A loss over this rank's tokens: its sum and (for a mean) its count, each summed over cp."""
    weight_at, reduction_at = rules.LOSSES[node.target]
    args = list(node.args)
    while len(args) <= reduction_at:
        args.append(_default(node.target, len(args)))
    args[reduction_at] = 2  # sum
    node.args, node.kwargs = tuple(args), {k: v for k, v in node.kwargs.items() if k != "reduction"}
    total = _after(g, node, CP.cp_all_reduce.default, [node])
    if how == "sum":
        return
    users = list(total.users)
    count = _count(g, node, weight_at, total)
    with g.inserting_after(count):
        mean = g.call_function(aten.div.Tensor, (total, count))
    mean.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
    mean.meta["val"] = _val(total)
    for user in users:
        user.replace_input_with(total, mean)


def _default(target, index: int):
    argument = target._schema.arguments[index]
    return argument.default_value


def _count(g: fx.Graph, node, weight_at, before) -> fx.Node:
    """The count a mean divides by, over every cp rank: the tokens not ignored (their weights, with a class
    weight), or the elements of the input."""
    fake = _val(node)
    new = []

    def call(target, *args, **kwargs):
        with g.inserting_after(new[-1] if new else before):
            made = g.call_function(target, args, kwargs)
        made.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
        new.append(made)
        return made

    target_node = node.args[1]
    if node.target in rules.IGNORE_INDEX:
        ignore = _arg(node, rules.IGNORE_INDEX[node.target], "ignore_index", -100)
        kept = call(aten.ne.Scalar, target_node, ignore)
        kept.meta["val"] = _val(target_node).new_empty(_val(target_node).shape, dtype=torch.bool)
        weight = _arg(node, weight_at, "weight")
        if isinstance(weight, fx.Node):
            safe = call(aten.where.ScalarOther, kept, target_node, 0)
            safe.meta["val"] = _val(target_node).new_empty(_val(target_node).shape)
            per = call(aten.index.Tensor, weight, [safe])
            per.meta["val"] = _val(weight).new_empty(_val(target_node).shape)
            mul = call(aten.mul.Tensor, per, kept)
            mul.meta["val"] = per.meta["val"]
            local = call(aten.sum.default, mul)
        else:
            local = call(aten.sum.default, kept, dtype=fake.dtype)
    else:
        ones = call(aten.ones_like.default, node.args[0])
        ones.meta["val"] = _val(node.args[0]).new_empty(_val(node.args[0]).shape)
        local = call(aten.sum.default, ones)
    local.meta["val"] = fake.new_empty([])
    total = call(CP.cp_all_reduce.default, local)
    total.meta["val"] = fake.new_empty([])
    return total


# ---- the loss, traced from the model file's loss_fn

@dataclass
class LossGraph:
    """The model file's ``loss_fn(output, target)`` traced (``tracepp/trace_loss.py``): its graph takes the
    model output's tensor leaves, then the target's leaves. ``inputs``: placeholder name -> the model output
    leaf it stands for (None: a target leaf)."""

    graph: fx.Graph
    inputs: dict  # placeholder name -> output leaf index, or None for a target leaf
    target_spec: object = None
    output_count: int = 0  # how many output leaves come first

    def sequence(self, outputs: list):
        """The loss graph's own sequence length: that of the first sharded output leaf."""
        for name, index in self.inputs.items():
            if index is not None and outputs[index]:
                dim, groups = outputs[index]
                node = next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == name)
                return sympy.sympify(_sizes(_val(node))[dim] / groups)
        return None


def loss_callable(loss: LossGraph):
    """``loss_fn(output, target)`` running the rewritten loss graph as the last rank's script does (for planning on
    fake tensors: ``codegen.memory``)."""
    import torch.utils._pytree as pytree

    module = fx.GraphModule(torch.nn.Module(), loss.graph)

    def loss_fn(output, target):
        leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        out = module(*leaves, *pytree.tree_leaves(target))
        return out[0] if isinstance(out, (tuple, list)) else out
    return loss_fn


# ---- what cp would change, per segment (the tuner's figures)

def segment_figures(graph: fx.Graph, compute: list, segments: list, root_inputs: dict, fqn_of: dict,
                    needs_grad: dict, flops: dict, computable: set, tensor_bytes) -> None:
    """Add ``segments[k]["cp"]`` for ``plan --tune --cp-sizes``: the whole traced graph walked once (the
    placements do not depend on the cp size), and per segment of the table (``split.partition.segment_table``,
    nodes marked with their segment): ``sharded_flops`` (computed on sequence shards: 1/cp of them per rank;
    attention's too, each rank's queries against every key), ``sequence_activation_bytes`` (the floating values
    that carry a gradient and hold a shard: 1/cp kept per rank), ``kv_gather`` ([count, whole bytes] of the
    key/value all-gathers, as moved up past head repeats: each rank receives (cp - 1)/cp of them forward and sends
    as much back as dK/dV), ``sums`` ([count, bytes] of the partial sums all-reduced) and, of the values crossing
    the cut before the segment, those sent as shards (``cut_sequence_bytes``, ``cut_sequence_grad_bytes``: 1/cp
    of them per rank). A model the walk refuses gets ``{"refused": why}``; the traced ``sequence`` length says
    which cp sizes cut it into 2 x cp chunks."""
    from tracepp.split.partition import SEGMENT
    from tracepp.split.tensor_parallel import whole_graph_sequence

    seq = whole_graph_sequence(graph, root_inputs)
    if seq is None or not segments:
        return
    try:
        walk = _Walk(graph, seq, 2, needs_grad, {}, _expert_nodes(graph, fqn_of), True, True, fqn_of=fqn_of)
    except Exception as error:  # noqa: BLE001 - the table only serves the tuner: never fail a split for it
        walk, refused = None, f"{type(error).__name__}: {error}"
    else:
        refused = walk.refusals[0] if walk.refusals else None
    text = str(seq)
    if refused is not None or walk is None:
        for seg in segments:
            seg["cp"] = {"refused": refused, "sequence": text}
        return
    position = {node: index for index, node in enumerate(compute)}
    last_use: dict = {}
    for node in compute:
        for arg in node.all_input_nodes:
            if arg in position:
                last_use[arg] = max(last_use.get(arg, -1), position[node])
        if any(user.op == "output" for user in node.users):
            last_use[node] = len(compute)
    by_segment: dict = {}
    for node in compute:
        by_segment.setdefault(node.meta.get(SEGMENT), []).append(node)

    def floating_grad(node) -> bool:
        val = _val(node)
        return bool(needs_grad.get(node)) and isinstance(val, torch.Tensor) and val.dtype.is_floating_point

    for index, seg in enumerate(segments):
        nodes = by_segment.get(index, [])
        inside = set(nodes)
        held = [n for n in nodes if n in walk.shard or n in walk.items]
        gathered = dict.fromkeys(_gather_source(arg, walk) for consumer, arg in walk.gathers if consumer in inside)
        sums = [n for n in nodes if n in walk.sums]
        crossing = []
        if index and nodes:
            start = position[nodes[0]]
            crossing = [n for n in compute[:start] if last_use.get(n, -1) >= start and n not in computable
                        and isinstance(_val(n), torch.Tensor)]
        sent = [n for n in crossing if n in walk.shard]
        seg["cp"] = {
            "sequence": text,
            "sharded_flops": int(sum(flops.get(n.name, 0) for n in held)),
            "sequence_activation_bytes": int(sum(tensor_bytes(_val(n)) for n in nodes if n in walk.shard
                                                 and floating_grad(n))),
            "kv_gather": [len(gathered), int(sum(tensor_bytes(_val(n)) for n in gathered))],
            "sums": [len(sums), int(sum(tensor_bytes(_val(n)) for n in sums if isinstance(_val(n), torch.Tensor)))],
            "cut_sequence_bytes": int(sum(tensor_bytes(_val(n)) for n in sent)),
            "cut_sequence_grad_bytes": int(sum(tensor_bytes(_val(n)) for n in sent if floating_grad(n))),
        }


def _gather_source(arg, walk: _Walk):
    """The value a key/value gather of ``arg`` moves up to (past the ops that only repeat heads): what
    :class:`_Hoist` makes the all-gather carry."""
    while (arg.op == "call_function" and arg.target in _GATHER_THROUGH and len(arg.users) == 1
           and isinstance(arg.args[0], fx.Node) and arg.args[0] in walk.shard):
        arg = arg.args[0]
    return arg
