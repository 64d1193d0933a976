"""The stage graphs (and the loss) rewritten for context parallelism (``context_parallel``'s step three): every
placement a cp walk made becomes ``cp_shard`` cuts, key/value ``cp_all_gather``s hoisted to where their heads are
fewest, local sizes, causal masks from this rank's positions and loss sums with their counts."""
from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from tracepp.split import cp_loop, rules
from tracepp.split.cp_causal import SCANS as _SCANS
from tracepp.split.cp_walk import _Walk, _int, _sizes
from tracepp.split.rules import equal as _equal, val as _val, where
from tracepp.split.tp_rewrite import _fake_like, _floor_text, _local_val

if TYPE_CHECKING:
    from tracepp.split.context_parallel import CPPlan

aten = torch.ops.aten
CP = torch.ops.tracepp
WHOLE = "cp_whole"  # meta of an all-gather that feeds an op run on the whole sequence (not a key/value gather)


def _bytes(val) -> int:
    from tracepp.split.cost import tensor_bytes

    return int(tensor_bytes(val))


def _stage_record(walk: _Walk) -> dict:
    return {
        "reduced": [{"op": rules.op_name(n), "line": where(n)} for n in list(walk.sums) + list(walk.maxima)],
        "causal": len(walk.causal),
        "scans": [{"op": rules.op_name(n), "line": where(n)} for n in walk.scans] + [
            {"op": f"a recurrence over {record[0]} positions", "line": where(stack)}
            for stack, record in walk.position_loops.items() if record[1]],
        "sharded_values": sum(1 for n in walk.shard if n.op != "placeholder"),
        "whole": whole_record(walk),
    }


def whole_record(walk: _Walk) -> list:
    """The ops a walk runs on the whole sequence, each with its line and why no rule placed it."""
    return [{"op": rules.op_name(n), "node": n.name, "line": where(n), "why": why}
            for n, why in walk.whole_ops.items()]


def _exchange(g: fx.Graph, cp: int) -> dict:
    """What a rewritten stage graph holds of context parallelism: the values cut to this rank's positions (by
    the value they cut, after the cuts moved up to the positions) and its key/value all-gathers, each with its
    whole shape; ``kv_bytes``: the whole keys and values gathered per microbatch forward (each rank receives
    (cp - 1) / cp of them, and as many go back as dK/dV in backward's reduce-scatter)."""
    cut, gathered, halos, whole, positions = [], [], [], [], 0
    for node in g.nodes:
        if node.op != "call_function":
            continue
        if node.target is CP.cp_halo.default:  # each chunk's last min(reach, chunk) positions, every rank's
            x, dim, reach = node.args[:3]
            shape = list(_val(x).shape)
            kept = min(reach, shape[dim] // 2) if isinstance(shape[dim], int) else reach
            shape[dim] = 2 * cp * kept
            count = rules.prod(shape)
            halos.append({"value": x.name, "reach": reach, "shape": [str(s) for s in shape],
                          "bytes": int(count) * _val(x).element_size() if isinstance(count, int) else 0,
                          "line": where(node)})
        elif node.target is CP.cp_shard.default:
            cut.append(node.args[0].name)
        elif node.target is CP.cp_positions.default:
            positions += 1
        elif node.target is CP.cp_all_gather.default and node.meta.get(WHOLE):
            whole.append({"value": node.args[0].name, "shape": [str(s) for s in _val(node).shape],
                          "bytes": _bytes(_val(node)), "line": where(node)})
        elif node.target is CP.cp_all_gather.default:
            val = _val(node)
            repeats = node.args[3] if len(node.args) > 3 else 1  # heads repeated after the exchange
            shape = list(val.shape)
            if repeats > 1:
                shape[node.args[4]] = shape[node.args[4]] // repeats
            gathered.append({"value": node.args[0].name, "shape": [str(s) for s in shape],
                             "dtype": str(val.dtype).replace("torch.", ""), "bytes": _bytes(val) // repeats,
                             "repeats": repeats, "line": where(node)})
    return {"cut": cut, "positions": positions, "gathered": gathered, "halos": halos,
            "kv_bytes": sum(item["bytes"] for item in gathered),
            "kv_received_bytes_per_rank": sum(item["bytes"] for item in gathered) * (cp - 1) // cp,
            "whole_gathered": whole, "whole_bytes": sum(item["bytes"] for item in whole)}


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


def _gather_all(g: fx.Graph, walk: _Walk, pairs: list, whole: bool) -> None:
    """Each ``(consumer, sharded input)`` of ``pairs`` reads the input all-gathered over cp in sequence order (one
    gather per input, before its first consumer); ``whole``: the gather feeds an op run on the whole sequence (marked
    so, told apart from attention's key/value gathers by :func:`_exchange`, and given its consumer's line)."""
    gathered: dict = {}
    for consumer, arg in pairs:
        if arg not in gathered:
            dim, groups = walk.shard[arg]
            consumers = [c for c, a in pairs if a is arg]
            gathered[arg] = _insert(g, _anchor(g, arg, consumers), CP.cp_all_gather.default,
                                    [arg, dim] + ([groups] * (groups > 1)), _val(arg), consumers[0] if whole else arg)
            if whole:
                gathered[arg].meta[WHOLE] = True
        consumer.replace_input_with(arg, gathered[arg])


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
            for user in list(arg.users):  # (an op run on the whole sequence reads it whole)
                if user is not cut[key] and user.op != "output" and user not in walk.whole_ops:
                    user.replace_input_with(arg, cut[key])
    _gather_all(g, walk, walk.gathers, whole=False)  # attention's keys and values
    _gather_all(g, walk, walk.whole_gathers, whole=True)  # what an op no rule places reads (cp_walk._run_whole)
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
    for node, (dims, keepdim) in walk.maxima.items():
        _maximum(g, node, dims, keepdim)
    for node, how in walk.losses.items():
        _loss_sum(g, node, how)
    for node in walk.sizes:  # the size of a shard's sequence dim, read inside the graph: the whole length
        _after(g, node, operator.mul, [node, cp], node)
    for node, (dim, _groups) in walk.local_factories.items():  # made for this rank's positions
        args = list(node.args)
        if node.target is aten.arange.default:
            args[0] = _local_size(g, args[0], cp, node)
        elif node.target is aten.arange.start_step:  # (0, numel, k): offsets of bags of k (cp_walk._on_bag)
            args[1] = _local_size(g, args[1], cp, node)
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
    for node, (kind, dim, reach) in walk.halos.items():
        _halo(g, node, kind, dim, reach, walk)
    for node, dim in walk.scans.items():  # each chunk's running values plus the chunks' before it
        x, dtype = node.args[0], rules.arg(node, 2, "dtype", None)
        if dtype is not None and dtype != _val(x).dtype:  # cumsum(x, dim, dtype=...): the cast first
            x = _insert(g, node, aten._to_copy.default, [x], _val(x).to(dtype), node, {"dtype": dtype})
        node.target, node.args, node.kwargs = _SCANS[node.target], (x, dim), {}
    for node, entries in walk.items.items():
        val = _val(node)
        if isinstance(val, (list, tuple)):
            node.meta["val"] = type(val)(_local_val(v, e[0], cp) if e is not None and isinstance(v, torch.Tensor)
                                         else v for v, e in zip(val, entries))
    for stack, record in walk.position_loops.items():  # each rank runs its own positions' steps
        walk.dead.extend(cp_loop.rewrite(g, stack, record, record[0] // cp, functools.partial(_insert, g),
                                         CP.cp_linear_scan.default))
    for node in reversed(walk.dead):  # read by nothing: not computed on this rank's positions, not computed at all
        if not node.users:
            g.erase_node(node)
    _Hoist(g, walk, cp).run()
    g.lint()




_GATHER_THROUGH = {  # ops between a shard and its key/value gather that only repeat or regroup heads
    aten.repeat_interleave.self_int, aten.expand.default, aten.unsqueeze.default, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.transpose.int, aten.permute.default, aten.repeat.default,  # repeat: tiled heads (its positions repeated once)
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
        # values written in place (through their views): a cut is not moved above them, where a value made for this
        # rank's positions would miss the writes (litgpt's sliding-window mask: torch.full((T, T), -inf), then
        # mask[i, start:i + 1] = 0 row by row; its rows are taken where the attention reads it)
        self.written = rules.written_roots(g)

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
            head = rules.arg(x, 2, "dim")
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
        if x.op != "call_function" or not isinstance(_val(x), torch.Tensor) or rules.view_root(x) in self.written:
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
            if rules.writes(x):  # an in-place op (or an out= variant): not remade on the rank's positions
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
        if target in rules.TRANSPOSES:
            source_dim = next(d for d in range(val.dim()) if rules.moved_dim(x, d) == dim)
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
        if target is CP.cp_all_gather.default and tuple(x.args[1:]) in ((dim,), (dim, groups)) and (
                len(x.args) > 2 or groups == 1):  # this rank's positions of what it gathered: the input itself
            return x.args[0]
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


def _halo(g: fx.Graph, node, kind: str, dim: int, reach: int, walk: _Walk) -> None:
    """A causal op along the sequence (``cp_walk._causal``, ``_causal_pad``) on each chunk with the ``reach``
    positions before it (``cp_halo``: ``[before_a, chunk_a, before_b, chunk_b]``), unpadded, then the ``reach`` values
    between the two chunks dropped (``cp_unhalo``). The node the walk placed keeps its name and this rank's value:

    * ``conv``: ``conv1d(x, padding=reach)`` on the halo, unpadded; its cuts back to the sequence become the drop;
    * ``shift``: the pad ``(s, -s)`` becomes the drop of ``pad(halo, (0, -s))`` (each chunk's own last ``s`` go);
    * ``padded``: the pad ``(reach, 0)`` becomes the halo, and each unpadded ``conv1d`` reading it the drop of a copy
      of itself."""
    x = node.args[0]
    local = _val(x)  # this rank's positions (the shard's sizes were made local above)
    shape = list(local.shape)
    shape[dim] = shape[dim] + 2 * reach
    halo_val = _fake_like(local, shape)
    if kind == "conv":
        halo = _insert(g, node, CP.cp_halo.default, [x, dim, reach], halo_val, node)
        args = list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2:]  # (input, weight, bias, stride,
        args[0], args[4] = halo, [0]                                            #  padding, dilation, groups)
        node.args, node.kwargs = tuple(args), {}
        out = list(_val(node).shape)
        out[dim] = local.shape[dim] + reach
        node.meta["val"] = _fake_like(_val(node), out)
        for user in list(node.users):
            user.target, user.args, user.kwargs = CP.cp_unhalo.default, (node, dim, reach), {}
        return
    if kind == "shift":
        halo = _insert(g, node, CP.cp_halo.default, [x, dim, reach], halo_val, node)
        pad = list(node.args[1])
        at = rules.pad_index(local.dim(), dim)
        pad[at], pad[at + 1] = 0, -reach
        out = list(_val(node).shape)  # this rank's (the walk placed it)
        out[dim] = out[dim] + reach
        cropped = _insert(g, node, node.target, [halo, pad] + list(node.args[2:]), _fake_like(_val(node), out), node,
                          dict(node.kwargs))
        node.target, node.args, node.kwargs = CP.cp_unhalo.default, (cropped, dim, reach), {}
        return
    node.target, node.args, node.kwargs = CP.cp_halo.default, (x, dim, reach), {}  # "padded"
    node.meta["val"] = halo_val
    for user in [u for u in node.users if u in walk.unhalos]:
        out = list(_val(user).shape)  # this rank's (the walk placed it)
        out[dim] = out[dim] + reach
        conv = _insert(g, user, user.target, list(user.args), _fake_like(_val(user), out), user, dict(user.kwargs))
        user.target, user.args, user.kwargs = CP.cp_unhalo.default, (conv, dim, reach), {}


def _last_placeholder(g: fx.Graph):
    return [n for n in g.nodes if n.op == "placeholder"][-1]


def _maximum(g: fx.Graph, node, dims: list, keepdim: bool) -> None:
    """A maximum over the sequence (``amax``, or the values of ``max.dim``, whose index nothing reads) made the
    maximum of every cp rank's (``cp_amax``)."""
    x = node.args[0]
    if node.target is aten.amax.default:
        node.target, node.args, node.kwargs = CP.cp_amax.default, (x, dims, keepdim), {}
        return
    values = [user for user in node.users if user.target is operator.getitem and user.args[1] == 0]
    if not values:
        return
    new = _insert(g, node, CP.cp_amax.default, [x, dims, keepdim], _val(values[0]), values[0])
    for user in values:
        user.replace_all_uses_with(new)
        g.erase_node(user)
    for user in [u for u in node.users if not u.users]:  # the index nothing reads
        g.erase_node(user)
    if not node.users:
        g.erase_node(node)


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
    device = _val(q).device
    with g.inserting_before(node):  # the keys' length read from the (gathered) keys as the rank runs: a sequence
        size = g.call_function(aten.sym_size.int, (k, _val(k).dim() - 2))  # that changes per step (a dynamic dim)
        rows = g.call_function(CP.cp_positions.default, (size,), {"device": device})  # had a mask of the example's
        keys = g.call_function(aten.arange.default, (size,), {"device": device})
        column = g.call_function(aten.unsqueeze.default, (rows, -1))
        mask = g.call_function(aten.ge.Tensor, (column, keys))
    for new in (size, rows, keys, column, mask):
        new.meta.update({k2: v for k2, v in node.meta.items() if k2 in ("stack_trace", "nn_module_stack")})
    size.meta["val"] = _val(k).shape[-2]
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
        ignore = rules.arg(node, rules.IGNORE_INDEX[node.target], "ignore_index", -100)
        kept = call(aten.ne.Scalar, target_node, ignore)
        kept.meta["val"] = _val(target_node).new_empty(_val(target_node).shape, dtype=torch.bool)
        weight = rules.arg(node, weight_at, "weight")
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
