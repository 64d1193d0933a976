"""The stage graphs rewritten for tensor parallelism (``tensor_parallel``'s step three): every placement a settled walk
made becomes local sizes, ``tp_*`` / ``sp_*`` collectives and parameter shards."""
from __future__ import annotations

import operator
import sys
from typing import TYPE_CHECKING

import sympy
import torch
import torch.fx as fx

from tracepp.split import rules, tp_grads
from tracepp.split.rules import ints as _ints, val as _val
from tracepp.split.tp_contract import _swapped
from tracepp.split.tp_walk import _Walk

if TYPE_CHECKING:
    from tracepp.split.tensor_parallel import TPPlan

aten = torch.ops.aten
TP = torch.ops.tracepp

_END = sys.maxsize  # a slice to the end


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
    a value sent as a shard (of the sequence, or of heads) crosses its boundary with its local shape (1/tp of it)."""
    for stage, walk in zip(graph.stages, walks):
        _rewrite(stage.graph, walk, tp_plan.size, tp_plan.params)
    for name, dim in tp_plan.sent.items():
        shape = list(graph.values[name].meta.shape)
        size = shape[dim]
        shape[dim] = size // tp_plan.size if isinstance(size, int) else _floor_text(size, tp_plan.size)
        graph.values[name].meta.shape = shape


def _rank_bags(g: fx.Graph, node, tp: int) -> None:
    """``embedding_bag(weight, indices, offsets, ..., per_sample_weights)`` of this rank's rows of the table: each
    index made this rank's (``tp_vocab_rows``; -1 where another rank holds the row, looked up at 0) and weighted 0
    there, so that the ranks' bags sum to the whole one (``walk.sums`` all-reduces output 0)."""
    from tracepp.split.decompose import _fake

    weight, indices = node.args[0], node.args[1]
    weights = rules.named(node, "per_sample_weights")

    def made(target, *args):
        return _insert(g, node, target, list(args), _fake(target, args, {}), node)

    local = made(TP.tp_vocab_rows.default, indices, int(_val(weight).shape[0]) // tp)
    inside = made(aten.to.dtype, made(aten.ge.Scalar, local, 0), _val(weight).dtype)
    share = made(aten.mul.Tensor, weights, inside) if isinstance(weights, fx.Node) else inside
    node.update_arg(1, made(aten.clamp_min.default, local, 0))
    at = [spec.name for spec in node.target._schema.arguments].index("per_sample_weights")
    if at < len(node.args):
        node.update_arg(at, share)
    else:
        node.update_kwarg("per_sample_weights", share)


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


def _rewrite_max(g: fx.Graph, node) -> None:
    """A maximum over the sharded dim (``amax``, ``max()``, ``max(x, dim)`` whose values alone are read) becomes
    ``tp_amax``; a minimum ``-tp_amax(-x)`` (its gradient, through the negations, to the elements holding it)."""
    dims, keep = rules.reduction(node)
    source, negated = node.args[0], rules.partial_kind(node) == "min"
    if negated:
        source = _insert(g, node, aten.neg.default, [source], _val(source), node)
    value = [node] if node.target not in (aten.max.dim, aten.min.dim) else [  # its indices read by nothing
        user for user in node.users if user.args[1] == 0]
    for out in value:
        out.target, out.args, out.kwargs = TP.tp_amax.default, (source, dims, keep), {}
        if negated:
            _after(g, out, aten.neg.default, [out])


def _channels(g: fx.Graph, anchor, bias, node=None) -> fx.Node:
    """A row-wise convolution's ``bias`` (``[channels]``) viewed along its output's channels, dim 1 (``[channels, 1,
    ...]``), inserted before ``anchor``, to be added after the sum; any other linear's as it is."""
    node = node or anchor
    if node.target not in rules.CONVS:
        return bias
    shape = [-1] + [1] * (_val(node).dim() - 2)
    return _insert(g, anchor, aten.view.default, [bias, shape], _val(bias).view(shape), node)


def _gathered(g: fx.Graph, anchor, arg, walk: _Walk) -> fx.Node:
    """``arg``'s shards joined before ``anchor``. A value of a fused projection's parts (``walk.segs``: the parts'
    whole widths) holds each part's piece side by side on every rank: equal parts are joined part by part by the
    gather itself (its ``groups``); unequal ones (litgpt's fused ``qkv``, 4 query heads and 2 key/value heads, read
    whole by its adapter's view) are gathered rank by rank and put back in the parts' order, each part's pieces
    side by side, by a split and a cat."""
    dim, segs = walk.shard[arg], walk.segs.get(arg)
    groups = walk.groups_of(segs) if segs else 1
    joined = _insert(g, anchor, TP.tp_all_gather.default, [arg, dim] + ([groups] * (groups > 1)), _val(arg), arg)
    if groups:
        return joined
    whole = _val(arg)
    shape = list(whole.shape)
    sizes = [size // walk.tp for size in segs] * walk.tp
    split = _insert(g, anchor, aten.split_with_sizes.default, [joined, sizes, dim], None, arg)
    pieces = []
    for size in sizes:
        pieces.append(_fake_like(whole, shape[:dim] + [size] + shape[dim + 1:]))
    split.meta["val"] = pieces
    items = []
    for index in range(len(sizes)):
        item = _insert(g, anchor, operator.getitem, [split, index], pieces[index], arg)
        items.append(item)
    order = [rank * len(segs) + part for part in range(len(segs)) for rank in range(walk.tp)]
    return _insert(g, anchor, aten.cat.default, [[items[k] for k in order], dim], whole, arg)


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
        for arg in rules.written(node):
            if isinstance(arg, fx.Node):
                root = rules.view_root(arg)
                written[root] = max(written.get(root, -1), order[node])
    first: dict = {}
    for consumer, arg in pairs:
        if consumer in order and (arg not in first or order[consumer] < order[first[arg]]):
            first[arg] = consumer

    def at(consumer, arg):
        last = written.get(rules.view_root(arg))  # a write into the value or anything it is a view of
        if last is None:
            return arg, (arg.next if arg.op != "placeholder" else next(n for n in g.nodes if n.op != "placeholder"))
        if last > order.get(first.get(arg), -1):
            return (arg, consumer), consumer
        return arg, first[arg]
    return at


def _cut_dim(walk, params: dict, source) -> int:
    """The sharded dim of a value a cut reads: the walk's placement, or for a parameter cut where it is read (a
    packed projection's weight chunked into q, k and v: ``nn.MultiheadAttention`` given three tensors) its plan's."""
    if source in walk.shard:
        return walk.shard[source]
    return params[walk._param(source)]["dim"]


def _rewrite(g: fx.Graph, walk: _Walk, tp: int, params: dict) -> None:
    for join, (_dim, _origin, kept) in walk.loop_joins.items():  # a loop over heads: this rank's heads joined
        join.update_arg(0, list(join.args[0])[:kept])
    for node in reversed([n for n in g.nodes if n in walk.loop_dead]):  # the other ranks' heads: not run here
        g.erase_node(node)
    summed: dict = {}  # (reader, value) -> the tp_copy it reads instead
    for value, readers in tp_grads.backward_sums(walk).items():  # the gradient's parts summed at this value
        if readers:
            copy = _insert(g, readers[0], TP.tp_copy.default, [value], _val(value), readers[0])
            for reader in readers:
                reader.replace_input_with(value, copy)
                summed[(reader, value)] = copy
    partial_pieces = tp_grads.piece_reads(walk)  # read at a piece, the gradient a part: no gather
    late = tp_grads.holding(walk)  # values holding partial gradients: a bias among them is read without a copy
    whole: dict = {}
    for node, dim in walk.gathered_out.items():  # a gathered down-projection: every reader reads it whole
        users = list(node.users)
        whole[node] = _insert(g, node.next, TP.tp_all_gather.default, [node, dim], _val(node), node)
        for user in users:
            user.replace_input_with(node, whole[node])
    gathered: dict = {}
    made_whole: dict = {}  # (consumer, sharded input) -> the gathered value it reads (a scatter below reads that)
    walk_gathers = [(consumer, arg) for consumer, arg in walk.gathers if arg not in whole]
    at = _reading(g, walk_gathers)
    for consumer, arg in walk_gathers:
        key, anchor = at(consumer, arg)
        if key not in gathered:
            gathered[key] = _gathered(g, anchor, arg, walk)
        consumer.replace_input_with(arg, gathered[key])
        made_whole[(consumer, arg)] = gathered[key]
    copies: dict = {}  # after the gathers: a value both gathered and read beside pieces is copied whole
    dead = tp_grads.dead(walk)  # values whose gradient reaches nothing: no sum to place
    walk_copies = [(consumer, made_whole.get((consumer, arg), whole.get(arg, arg))) for consumer, arg in walk.copies
                   if arg not in dead]
    placed = tp_grads.partial_values(walk)  # whole values whose gradients' sums tp_grads placed: copied above
    walk_copies = [(consumer, arg) for consumer, arg in walk_copies if arg not in placed]
    at = _reading(g, walk_copies)
    for consumer, arg in walk_copies:
        key, anchor = at(consumer, arg)
        if key not in copies:
            copies[key] = _insert(g, anchor, TP.tp_copy.default, [arg], _val(arg), consumer)
        consumer.replace_input_with(arg, copies[key])
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
    walk_scatters = [(consumer, summed.get((consumer, arg), made_whole.get((consumer, arg), whole.get(arg, arg))),
                      dim, groups, (consumer, arg) in partial_pieces)
                     for consumer, arg, dim, groups in walk.scatters]
    at = _reading(g, [(consumer, arg) for consumer, arg, _dim, _groups, _part in walk_scatters])
    for consumer, arg, dim, groups, part in walk_scatters:  # a whole value read beside pieces: this rank's piece
        key, anchor = at(consumer, arg)
        if (key, dim) not in pieces:
            if isinstance(groups, tuple):  # unequal segments: this rank's piece of each
                pieces[(key, dim)] = _insert(g, anchor, TP.tp_parts.default, [arg, dim, list(groups)],
                                             _local_val(_val(arg), dim, tp), consumer)
            else:  # its gradient pieces gathered, or (tp_piece) a part of the gradient summed where tp_grads put it
                pieces[(key, dim)] = _insert(g, anchor, TP.tp_piece.default if part else TP.tp_scatter.default,
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
            if node.target in rules.CONVS:  # its bias added after the sum (along the channels), its groups kept
                node.args = (x, weight, None, *node.args[3:])
            elif node.target is not aten.einsum.default:  # (an einsum's operands are as they were)
                node.args = (weight, x) if node.args[0] is weight else (x, weight)
            if node in walk.deferred:  # its partial sums carried on, all-reduced at walk.late_sums (tp_partial)
                if bias is not None:  # 1/tp of the bias on every rank: the partial sums add up to it once
                    share = bias
                    if walk.needs_grad.get(bias) and bias not in late:  # each rank's gradient is 1/tp of it
                        share = _insert(g, node, TP.tp_copy.default, [bias], _val(bias), node)
                    share = _insert(g, node, aten.div.Tensor, [share, tp], _val(bias), node)
                    _after(g, node, aten.add.Tensor, [node, _channels(g, node, share)], node)
                continue
            reduced = _after(g, node, *_reduction(node, scatter), local=(scatter, tp))
            if bias is not None:
                if scatter is not None and walk.needs_grad.get(bias) and bias not in late:  # added to its tokens
                    bias = _insert(g, reduced, TP.tp_copy.default, [bias], _val(bias), node)
                _after(g, reduced, aten.add.Tensor, [reduced, _channels(g, reduced, bias, node)], node)
        elif role == "vocab":
            weight, indices = node.args[0], node.args[1]
            if node.target is aten.index.Tensor:  # W_E[tokens, :]: its one index
                indices = indices[0]
            padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            node.target = TP.tp_vocab_embedding.default
            node.args = (weight, indices, padding) + ((False,) if scatter is not None else ())
            node.kwargs = {}
            if scatter is not None:
                _after(g, node, *_reduction(node, scatter), local=(scatter, tp))
    for node in walk.bags:  # a bag lookup of this rank's rows: the others' entries weighted 0 (summed below)
        _rank_bags(g, node, tp)
    for node in walk.late_sums:  # row-wise partial sums carried to here (tp_partial): summed once
        _after(g, node, TP.tp_all_reduce.default, [node])
    for node, (dim, index, owner) in walk.owned_selects.items():  # one index of the sharded dim: its owner's, else 0
        node.target, node.args, node.kwargs = TP.tp_owned_select.default, (node.args[0], dim, index, owner), {}
    for node, count in walk.sums.items():  # a sum (or mean) over the sharded dim: from the partial sums
        if count is not None:  # mean(x) -> sum(x); mean(x, dims, keepdim) -> sum(x, dims, keepdim)
            node.target = aten.sum.default if node.target is aten.mean.default else aten.sum.dim_IntList
        reduced = _after(g, node, TP.tp_all_reduce.default, [node])
        if count is not None:
            _after(g, reduced, aten.div.Tensor, [reduced, int(count) if _ints([count]) else count], node)
    for node in walk.maxes:  # a maximum (minimum) over the sharded dim: each rank's, all-reduced by MAX
        _rewrite_max(g, node)
    joined_from = {}  # the cat that now stands for a fused projection's linear -> that linear (its placement)
    for node, form in walk.mixed_linears.items():  # a fused projection with whole parts: one linear per run of parts
        joined_from[_rewrite_mixed_linear(g, node, form, tp)] = node
    for node, groups in walk.group_norms.items():  # a group norm of this rank's groups
        node.update_arg(1, groups)
    for node, groups in walk.conv_groups.items():  # a depthwise convolution on this rank's channels
        args = list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2:] if len(node.args) < 7 else list(node.args)
        args[6] = groups
        node.args, node.kwargs = tuple(args), {k: v for k, v in node.kwargs.items() if k != "groups"}
    for node, sizes in walk.owned_splits.items():  # pieces within ranks: the owner computes each, the rest empty
        source = node.args[0]
        node.target, node.args, node.kwargs = TP.tp_owned_split.default, (
            source, _cut_dim(walk, params, joined_from.get(source, source)), sizes), {}
    for node, pieces in walk.cuts.items():  # cuts of the sharded dim: the local parts
        source = node.args[0]
        dim = _cut_dim(walk, params, joined_from.get(source, source))
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
        if node.target in rules.VIEWS or node.target in rules.EXPANDS or node.target in rules.FRESH:
            sizes = list(node.args[1])
            if sizes[dim] != -1:
                sizes[dim] = sizes[dim] // tp
            node.args = (node.args[0], sizes) + tuple(node.args[2:])
        if node.target in rules.UNFLATTENS:  # unflatten(d, sizes): the size of the sharded one among d's dims
            sizes = list(node.args[2])
            at = dim - node.args[1] % _val(node.args[0]).dim()
            if sizes[at] != -1:
                sizes[at] = sizes[at] // tp
            node.args = (node.args[0], node.args[1], sizes)
        if node.target is aten.repeat_interleave.self_int:
            at = rules.arg(node, 2, "dim")  # heads repeated on the sharded dim: this rank's count of them
            if at is not None and at % _val(node).dim() == dim:
                if node.kwargs.get("output_size") is not None:
                    node.update_kwarg("output_size", node.kwargs["output_size"] // tp)
                if node.args[0] not in walk.shard:  # a dim of 1 repeated to this rank's heads (made on the piece)
                    node.update_arg(1, node.args[1] // tp)
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
