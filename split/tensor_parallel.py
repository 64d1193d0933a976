"""Tensor parallelism read from the traced graph: which parameters each stage shards over ``--tp`` ranks, and
the stage graphs rewritten to run on the shards.

The plan is Megatron's, found rather than written by hand. Every value of a stage graph is either
*replicated* (every tp rank holds all of it) or *sharded* on one dim (rank r holds the r-th of ``tp`` equal
contiguous pieces). Walking the graph in order:

* a linear whose weight is a parameter and whose input is replicated becomes **column-wise** (weight and bias
  split on the output features, ``Shard(0)``); its input passes through ``tp_copy`` (identity forward,
  all-reduce of the gradient backward) and its output is sharded on the last dim;
* ops that keep a sharded dim apart (elementwise ops, views that split it into heads or merge heads back,
  transposes, attention over the head dim, reductions over other dims, slices and concatenations of other
  dims) carry the sharding through; a replicated operand broadcast along the sharded dim (rotary tables, a
  per-head-dim norm weight, a per-token gate) may be read as it is, and one that carries a gradient (by the
  graph's flow from the parameters, not export's metadata) goes through ``tp_copy`` so its gradient is summed;
* a linear whose input is sharded on its last dim becomes **row-wise** (weight split on the input features,
  ``Shard(1)``): its partial product goes through ``tp_all_reduce`` and then takes the bias;
* an embedding whose weight is a parameter becomes **vocabulary-parallel** (``Shard(0)``);
* anything else that meets a sharded value gets it whole through ``tp_all_gather`` (the head's logits before
  the loss), and so do the stage's outputs: every value that crosses a stage boundary is replicated.

A column-wise linear whose output only ever gets gathered is kept only when it widens (the head: vocabulary
rows); otherwise it is replicated. A parameter must take one placement everywhere it is used (a tied
embedding and head, on one stage or two): where its uses disagree it is replicated. So is any dim that
``tp`` does not divide (grouped-query attention with fewer key/value heads than ``tp`` replicates its
attention), and whatever the model file's ``tp_plan`` (FQN pattern -> ``"replicate"``) names. Mixture-of-
experts weights (grouped matmuls) are replicated: experts are the expert-parallel issue's.

The result, :class:`TPPlan`, is plain data for the manifest; :func:`apply` rewrites the stage graphs.
"""
from __future__ import annotations

import fnmatch
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

import tracepp.runtime.tensor_parallel  # noqa: F401  (registers torch.ops.tracepp.tp_*)
from tracepp.split.partition import _gradient_flags

aten = torch.ops.aten
TP = torch.ops.tracepp

_UNARY = {
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.silu.default, aten.gelu.default,
    aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.exp.default,
    aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar, aten.square.default, aten.type_as.default,
    aten.lift_fresh_copy.default, aten.abs.default, aten.erf.default, aten.dropout.default,
}
_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
    aten.minimum.default, aten.where.self, aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
_SDPA = {aten.scaled_dot_product_attention.default}
_IGNORED = {aten._assert_tensor_metadata.default}  # metadata checks: dropped by codegen


@dataclass
class TPPlan:
    """Plain data: the tensor-parallel degree, each parameter's placement and the collectives per stage."""

    size: int
    params: dict = field(default_factory=dict)  # fqn -> {"dim": 0|1|None, "role": colwise|rowwise|vocab|replicate}
    stages: list = field(default_factory=list)  # per stage: {"collectives": [..], "replicated": [reasons]}

    def to_json(self) -> dict:
        return {"size": self.size, "params": self.params, "stages": self.stages}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _sizes(val) -> list:
    return [sympy.sympify(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(int(s)) for s in val.shape]


def _equal(a, b) -> bool:
    return sympy.expand(a - b) == 0


def _prod(items):
    out = sympy.Integer(1)
    for item in items:
        out = out * item
    return out


def _view_dim(in_sizes: list, out_sizes: list, dim: int, tp: int):
    """The output dim a sharded input ``dim`` lands on through a view (split into heads, merged back), or None
    where the pieces would not stay contiguous."""
    before = _prod(in_sizes[:dim])
    for e in range(len(out_sizes) + 1):
        if _equal(_prod(out_sizes[:e]), before):
            break
    else:
        return None
    if e >= len(out_sizes):
        return None
    size, out = in_sizes[dim], out_sizes[e]
    if _equal(size, out):
        return e
    if size.is_Integer and out.is_Integer and int(size) % int(out) == 0:  # split: the outer part is sharded
        return e if int(out) % tp == 0 else None
    if size.is_Integer and out.is_Integer and int(out) % int(size) == 0:  # merge: the sharded dim is outermost
        return e
    return None


class _Walk:
    """One pass over one stage graph under a set of replicated FQNs: each value's sharding and the edits."""

    def __init__(self, graph: fx.Graph, fqn_of: dict, tp: int, forced: set, needs_grad: dict):
        self.graph, self.fqn_of, self.tp, self.forced = graph, fqn_of, tp, forced
        self.needs_grad = needs_grad  # node -> carries a gradient (split.partition._gradient_flags)
        self.shard: dict = {}  # node -> sharded dim (absent: replicated)
        self.roles: dict = {}  # linear/embedding node -> "colwise" | "rowwise" | "vocab"
        self.uses: dict = {}  # fqn -> set of dims (None: used replicated)
        self.gathers: list = []  # (consumer node, input node)
        self.copies: list = []  # (consumer node, replicated input node)
        self.reasons: list = []
        for node in graph.nodes:
            self._visit(node)

    def reduced_in_backward(self) -> set:
        """The whole values whose gradient tp_copy sums over the group: those that carry one."""
        return {arg for _consumer, arg in self.copies if self.needs_grad.get(arg)}

    # -- helpers
    def _param(self, node):
        return self.fqn_of.get(node.name) if isinstance(node, fx.Node) and node.op == "placeholder" else None

    def _use(self, node, dim) -> None:
        fqn = self._param(node)
        if fqn is not None:
            self.uses.setdefault(fqn, set()).add(dim)

    def _gather_all(self, node) -> None:
        for arg in node.all_input_nodes:
            if arg in self.shard:
                self.gathers.append((node, arg))
        for arg in node.all_input_nodes:
            self._use(arg, None)

    # -- the rules
    def _visit(self, node) -> None:
        if node.op == "placeholder":
            return
        if node.op == "output":
            for arg in node.all_input_nodes:
                if arg in self.shard:
                    self.gathers.append((node, arg))
            return
        target = node.target
        sharded = [a for a in node.all_input_nodes if a in self.shard]
        if target is aten.linear.default and self._param(node.args[1]) is not None:
            return self._linear(node)
        if target is aten.embedding.default and self._param(node.args[0]) is not None and not sharded:
            return self._embedding(node)
        for arg in node.all_input_nodes:
            if arg not in self.shard:
                self._use(arg, None)
        if not sharded:
            return
        if target in _IGNORED:
            return
        handled = self._propagate(node, target, sharded)
        if not handled:
            if not (self.reasons and self.reasons[-1].startswith(f"{node.name} (")):
                self.reasons.append(f"{node.name} ({target}): needs the whole of "
                                    f"{', '.join(a.name for a in sharded)}")
            self._gather_all(node)

    def _linear(self, node) -> None:
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        fqn = self.fqn_of[weight.name]
        wval = _val(weight)
        ndim = len(_val(x).shape)
        if x in self.shard:
            if self.shard[x] == ndim - 1 and fqn not in self.forced and wval.dim() == 2:
                self.roles[node] = "rowwise"
                self._use(weight, 1)
                if bias is not None:
                    self._use(bias, None)
                return
            if fqn not in self.forced:
                self.reasons.append(f"{node.name}: input sharded on dim {self.shard[x]}, not its features")
            self._gather_all(node)
            return
        out_features = wval.shape[0]
        if fqn in self.forced or wval.dim() != 2 or int(out_features) % self.tp:
            if fqn not in self.forced:
                self.reasons.append(f"{fqn}: {out_features} output features, which --tp {self.tp} does not divide")
            self._use(weight, None)
            if bias is not None:
                self._use(bias, None)
            return
        self.roles[node] = "colwise"
        self._use(weight, 0)
        if bias is not None:
            self._use(bias, 0)
        self.copies.append((node, x))
        self.shard[node] = ndim - 1

    def _embedding(self, node) -> None:
        weight = node.args[0]
        fqn = self.fqn_of[weight.name]
        extra = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "padding_idx"]
        rows = _val(weight).shape[0]
        if fqn in self.forced or any(extra) or _val(weight).dim() != 2 or int(rows) % self.tp:
            if fqn not in self.forced:
                self.reasons.append(f"{fqn}: vocabulary of {rows} rows, which --tp {self.tp} does not divide"
                                    if int(rows) % self.tp else f"{fqn}: a sparse or frequency-scaled embedding")
            self._use(weight, None)
            return
        self.roles[node] = "vocab"
        self._use(weight, 0)

    def _propagate(self, node, target, sharded) -> bool:
        out_val = _val(node)
        if target is operator.getitem:
            self.shard[node] = self.shard[node.args[0]]
            return True
        first = node.args[0]
        if target is aten.cat.default:
            return self._cat(node)
        if target in _UNARY:
            if first not in self.shard or len(sharded) != 1:
                return False
            if target is aten.dropout.default and node.args[1]:
                return False
            self.shard[node] = self.shard[first]
            return True
        if target in _ELEMENTWISE:
            return self._elementwise(node, out_val)
        if first not in self.shard or len(sharded) != 1:
            if target in _SDPA:
                return self._attention(node)
            return False
        dim = self.shard[first]
        in_val = _val(first)
        ndim = in_val.dim()
        if target is aten.transpose.int:
            a, b = (d % ndim for d in node.args[1:3])
            self.shard[node] = b if dim == a else a if dim == b else dim
            return True
        if target is aten.permute.default:
            order = [d % ndim for d in node.args[1]]
            self.shard[node] = order.index(dim)
            return True
        if target is aten.unsqueeze.default:
            at = node.args[1] % (ndim + 1)
            self.shard[node] = dim + 1 if at <= dim else dim
            return True
        if target in (aten.squeeze.dim,):
            at = node.args[1] % ndim
            if at == dim:
                return False
            self.shard[node] = dim - 1 if at < dim else dim
            return True
        if target in _VIEWS:
            e = _view_dim(_sizes(in_val), _sizes(out_val), dim, self.tp)
            if e is None or not self._size_arg_ok(node.args[1], e, _sizes(out_val)[e]):
                self.reasons.append(f"{node.name} ({target}): reshapes a dim of {in_val.shape[dim]} sharded over "
                                    f"--tp {self.tp} into {list(out_val.shape)}, whose pieces would not be whole "
                                    f"heads (fewer heads than --tp, e.g. key/value heads of grouped-query attention)")
                return False
            self.shard[node] = e
            return True
        if target is aten.expand.default:
            offset = out_val.dim() - ndim
            e = dim + offset
            if not self._size_arg_ok(node.args[1], e, _sizes(out_val)[e]):
                return False
            self.shard[node] = e
            return True
        if target in (aten.slice.Tensor, aten.select.int, aten.narrow.default):  # (x, dim, ...)
            at = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % ndim
        elif target in (aten.split.Tensor, aten.split_with_sizes.default):  # (x, size(s), dim=0)
            at = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % ndim
        if target in (aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
                      aten.narrow.default):
            if at == dim:
                return False
            out_dim = dim - 1 if target is aten.select.int and at < dim else dim
            self.shard[node] = out_dim
            return True
        if target in _REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else None
            if not dims:
                return False
            dims = [d % ndim for d in dims]
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if dim in dims:
                return False
            self.shard[node] = dim if keep else dim - sum(1 for d in dims if d < dim)
            return True
        if target is aten.repeat_interleave.self_int:
            if (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) is None:
                return False  # flattened
            self.shard[node] = dim  # repeating heads in place keeps each rank's block contiguous
            return True
        if target in _SOFTMAX:
            if node.args[1] % ndim == dim:
                return False
            self.shard[node] = dim
            return True
        if target in _SDPA:
            return self._attention(node)
        return False

    def _cat(self, node) -> bool:
        parts = node.args[0]
        ndim = _val(parts[0]).dim()
        at = (node.args[1] if len(node.args) > 1 else 0) % ndim
        dims = {self.shard.get(p) for p in parts}
        if len(dims) != 1 or None in dims or at == next(iter(dims)):
            return False
        self.shard[node] = next(iter(dims))
        return True

    def _size_arg_ok(self, sizes, e: int, out_size) -> bool:
        """A view/expand's size list can be rewritten to the local size at dim ``e``: -1 there, or the global
        size as a literal int."""
        if not isinstance(sizes, (list, tuple)) or e >= len(sizes):
            return False
        at = sizes[e]
        return at == -1 or (isinstance(at, int) and out_size.is_Integer and at == int(out_size))

    def _elementwise(self, node, out_val) -> bool:
        n = out_val.dim()
        out_dim = None
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg in self.shard:
                e = self.shard[arg] + n - _val(arg).dim()
                if out_dim not in (None, e):
                    return False
                out_dim = e
        broadcast = []
        for arg in node.args:
            if not isinstance(arg, fx.Node) or arg in self.shard:
                continue
            val = _val(arg)
            if not isinstance(val, torch.Tensor):
                continue
            at = out_dim - (n - val.dim())
            if at >= 0 and val.shape[at] != 1:
                return False
            broadcast.append(arg)
        for arg in broadcast:  # each rank sees its share of the sharded dim: the gradient is summed over tp
            if self.needs_grad.get(arg):
                self.copies.append((node, arg))
        self.shard[node] = out_dim
        return True

    def _attention(self, node) -> bool:
        q, k, v = node.args[:3]
        if any(t not in self.shard or self.shard[t] != _val(t).dim() - 3 for t in (q, k, v)):
            return False
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            if mask in self.shard:
                if self.shard[mask] + 4 - _val(mask).dim() != 1:
                    return False
            else:
                mval = _val(mask)
                at = 1 - (4 - mval.dim())
                if at >= 0 and mval.shape[at] != 1:
                    return False
                if self.needs_grad.get(mask):
                    self.copies.append((node, mask))
        self.shard[node] = self.shard[q]
        return True


def _regions(walk: _Walk) -> list:
    """Connected groups of sharded values; each with its column-wise linears and whether one ends row-wise."""
    parent: dict = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    for node in walk.shard:
        for arg in node.all_input_nodes:
            if arg in walk.shard:
                parent[find(node)] = find(arg)
    groups: dict = {}
    for node in walk.shard:
        groups.setdefault(find(node), set()).add(node)
    for node, role in walk.roles.items():
        if role == "rowwise":
            groups[find(node.args[0])].add(node)
    return list(groups.values())


def _narrow_columns(walk: _Walk) -> dict:
    """{weight FQN: why} of column-wise linears whose sharded output never reaches a row-wise linear and is
    needed whole before the stage's end: the gather would cost what the shard saves. A column-wise linear whose
    output is gathered only to leave the stage (the head's logits) is kept."""
    out = {}
    for region in _regions(walk):
        if any(walk.roles.get(n) == "rowwise" for n in region):
            continue
        inside = [consumer for consumer, arg in walk.gathers if arg in region and consumer.op != "output"]
        if not inside:
            continue
        why = f"its output is needed whole by {inside[0].target}"
        for node in region:
            if walk.roles.get(node) == "colwise":
                out[walk.fqn_of[node.args[1].name]] = why
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


def settle(graphs: list, tp: int, notes: dict) -> tuple:
    """Walk ``graphs`` ([(fx graph, placeholder -> FQN, node -> needs a gradient)]) until every parameter has one placement: replicate
    the parameters whose uses disagree and the column-wise linears whose output is gathered before the stage's
    end, and walk again. Returns (walks, {fqn: set of dims}, per graph the reasons met in any pass); ``notes``
    (fqn -> why replicated; the forced set) is updated."""
    reasons = [{} for _ in graphs]  # per graph, every reason met in any pass, in order
    while True:
        walks = [_Walk(g, fqn_of, tp, set(notes), needs_grad) for g, fqn_of, needs_grad in graphs]
        uses: dict = {}
        narrow: dict = {}
        for walk, seen in zip(walks, reasons):
            seen.update(dict.fromkeys(walk.reasons))
            narrow.update(_narrow_columns(walk))
            for fqn, dims in walk.uses.items():
                uses.setdefault(fqn, set()).update(dims)
        for fqn, dims in uses.items():
            if len(dims) > 1:
                narrow.setdefault(fqn, "used sharded in one place and whole in another")
        new = {fqn: why for fqn, why in narrow.items() if fqn not in notes}
        if not new:
            return walks, uses, reasons
        notes.update(new)


def plan(graph, tp: int, overrides=None) -> tuple:
    """(TPPlan, the final walk per stage) for ``--tp tp``: iterate until every parameter has one placement."""
    aliases = {ref.fqn: ref.aliases for ref in graph.state.values()}
    notes = _forced_by_overrides(aliases, overrides)
    walks, uses, reasons = settle([(stage.graph, fqn_map(stage, graph), grad_flags(stage, graph))
                                   for stage in graph.stages], tp, notes)
    result = TPPlan(size=tp)
    roles: dict = {}
    for walk in walks:
        for node, role in walk.roles.items():
            weight = node.args[0] if role == "vocab" else node.args[1]
            roles[walk.fqn_of[weight.name]] = role
            if role == "colwise" and len(node.args) > 2 and node.args[2] is not None:
                roles.setdefault(walk.fqn_of[node.args[2].name], "colwise")
    for fqn, dims in sorted(uses.items()):
        dim = next(iter(dims))
        entry = {"dim": dim, "role": roles.get(fqn, "replicate") if dim is not None else "replicate"}
        if fqn in notes:
            entry["why"] = notes[fqn]
        result.params[fqn] = entry
    for pattern, how in (overrides or {}).items():
        if how == "replicate":
            continue
        for fqn, entry in result.params.items():
            if any(fnmatch.fnmatchcase(name, pattern) for name in aliases.get(fqn, [fqn])) and entry["role"] != how:
                raise ValueError(f"tp_plan[{pattern!r}] = {how!r}, but {fqn} can only be {entry['role']} in the "
                                 f"traced graph (its input is {'sharded' if entry['role'] == 'rowwise' else 'whole'}"
                                 f" there); use 'replicate' or drop the entry")
    for walk, seen in zip(walks, reasons):
        result.stages.append({"collectives": _collectives(walk, tp), "replicated": list(seen)[:20]})
    return result, walks


def _collectives(walk: _Walk, tp: int) -> list:
    """The communication the rewrite adds to one stage's forward, one line each (backward mirrors it)."""
    out = []
    for node, role in walk.roles.items():
        if role in ("rowwise", "vocab"):
            out.append({"op": "all_reduce", "after": node.name, "shape": [str(s) for s in _val(node).shape],
                        "dtype": str(_val(node).dtype).replace("torch.", "")})
    for _consumer, arg in dict.fromkeys(walk.gathers):
        out.append({"op": "all_gather", "after": arg.name, "shape": [str(s) for s in _val(arg).shape],
                    "dtype": str(_val(arg).dtype).replace("torch.", "")})
    for arg in walk.reduced_in_backward():
        out.append({"op": "all_reduce (backward)", "after": arg.name, "shape": [str(s) for s in _val(arg).shape],
                    "dtype": str(_val(arg).dtype).replace("torch.", "")})
    return out


# ---- the rewrite

def _local_val(val, dim: int, tp: int):
    shape = list(val.shape)
    shape[dim] = shape[dim] // tp
    return val.new_empty(shape)


def apply(graph, tp_plan: TPPlan, walks: list) -> None:
    """Rewrite every stage graph in place to compute on this rank's shards (the same code on every tp rank)."""
    for stage, walk in zip(graph.stages, walks):
        _rewrite(stage.graph, walk, tp_plan.size, tp_plan.params)


def _insert(g: fx.Graph, before, target, args, val, like) -> fx.Node:
    with g.inserting_before(before):
        node = g.call_function(target, tuple(args))
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    node.meta["val"] = val
    return node


def _rewrite(g: fx.Graph, walk: _Walk, tp: int, params: dict) -> None:
    copies: dict = {}
    for consumer, arg in walk.copies:
        if arg not in copies:
            anchor = arg.next if arg.op != "placeholder" else next(n for n in g.nodes if n.op != "placeholder")
            copies[arg] = _insert(g, anchor, TP.tp_copy.default, [arg], _val(arg), consumer)
        consumer.replace_input_with(arg, copies[arg])
    gathered: dict = {}
    for consumer, arg in walk.gathers:
        if arg not in gathered:
            dim = walk.shard[arg]
            gathered[arg] = _insert(g, arg.next, TP.tp_all_gather.default, [arg, dim], _val(arg), arg)
        consumer.replace_input_with(arg, gathered[arg])
    for node, role in walk.roles.items():
        if role == "rowwise":
            bias = node.args[2] if len(node.args) > 2 else None
            node.args = (node.args[0], node.args[1])
            users = list(node.users)
            reduced = _insert(g, node.next, TP.tp_all_reduce.default, [node], _val(node), node)
            last = reduced
            if bias is not None:
                last = _insert(g, reduced.next, aten.add.Tensor, [reduced, bias], _val(node), node)
            for user in users:
                user.replace_input_with(node, last)
        elif role == "vocab":
            weight, indices = node.args[0], node.args[1]
            padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            node.target = TP.tp_vocab_embedding.default
            node.args = (weight, indices, padding)
            node.kwargs = {}
    for node, dim in walk.shard.items():  # local sizes: in view/expand arguments and in the annotations
        if node.target in _VIEWS or node.target is aten.expand.default:
            sizes = list(node.args[1])
            if sizes[dim] != -1:
                sizes[dim] = sizes[dim] // tp
            node.args = (node.args[0], sizes) + tuple(node.args[2:])
        val = _val(node)
        if isinstance(val, torch.Tensor):
            node.meta["val"] = _local_val(val, dim, tp)
        elif isinstance(val, (list, tuple)):
            node.meta["val"] = type(val)(_local_val(v, dim, tp) for v in val)
    for ph in g.nodes:  # a sharded parameter's annotation: its local shape
        if ph.op != "placeholder" or ph.name not in walk.fqn_of:
            continue
        dim = params.get(walk.fqn_of[ph.name], {}).get("dim")
        if dim is not None:
            ph.meta["val"] = _local_val(_val(ph), dim, tp)
    g.lint()


# ---- what tp would change, per segment (the tuner's figures)

TUNED_SIZES = (2, 4, 8)


def whole_graph_walks(graph: fx.Graph, fqn_of: dict, needs_grad: dict, sizes=TUNED_SIZES) -> dict:
    """{tp: the settled walk of the whole traced graph}: the plan ``--tp tp`` would make, seen before any cut
    (stage outputs are not gathered here; boundaries carry replicated values in any case)."""
    out = {}
    for tp in sizes:
        walks, uses, _reasons = settle([(graph, fqn_of, needs_grad)], tp, {})
        dims = {fqn: next(iter(d)) for fqn, d in uses.items()}
        out[tp] = {"walk": walks[0], "dims": dims, "attributed": set()}
    return out


def segment_figures(nodes: list, walks: dict, flops: dict, tensor_bytes) -> dict:
    """Per tp size, for one segment's nodes (the tuner prices a segment at tp with these): the forward FLOPs
    computed on shards, the parameters sharded (counted at the segment of their first use), and the collectives
    per microbatch: forward all-reduces (row-wise outputs, vocabulary lookups), backward all-reduces (gradients
    of the replicated inputs of sharded ops) and all-gathers, each as [count, bytes]."""
    out = {}
    for tp, entry in walks.items():
        walk, dims, attributed = entry["walk"], entry["dims"], entry["attributed"]
        inside = set(nodes)
        sharded_flops = sum(flops.get(n.name, 0) for n in nodes  # column-wise outputs are in walk.shard
                            if n in walk.shard or walk.roles.get(n) == "rowwise")
        params = bytes_ = 0
        for node in nodes:
            for arg in node.all_input_nodes:
                fqn = walk._param(arg)
                if fqn is not None and fqn not in attributed:
                    attributed.add(fqn)
                    if dims.get(fqn) is not None:
                        params += _val(arg).numel()
                        bytes_ += tensor_bytes(_val(arg))
        reduce_fwd = [n for n in nodes if walk.roles.get(n) in ("rowwise", "vocab")]
        copied = {arg for consumer, arg in walk.copies if consumer in inside} & walk.reduced_in_backward()
        gathered = {arg for consumer, arg in walk.gathers if consumer in inside or (consumer.op == "output"
                                                                                    and arg in inside)}
        out[str(tp)] = {
            "sharded_flops": int(sharded_flops), "sharded_params": int(params), "sharded_param_bytes": int(bytes_),
            "all_reduce": [len(reduce_fwd), sum(tensor_bytes(_val(n)) for n in reduce_fwd)],
            "all_reduce_backward": [len(copied), sum(tensor_bytes(_val(a)) for a in copied)],
            "all_gather": [len(gathered), sum(tensor_bytes(_val(a)) for a in gathered)]}
    return out
