"""Every rank's program run in one process with the collectives' semantics (what torch's LocalTensor mode does for
DTensor programs): a rewritten stage graph is one program for every rank of its tp x cp grid, interpreted once with
each value a list of per-rank values. An ordinary op runs on each rank's operands; tracepp's collectives
(``runtime/tensor_parallel.py``, ``runtime/context_parallel.py``) are computed across their group's values by an
autograd function whose backward is the runtime's (a ``tp_copy`` sums its ranks' gradients, a ``tp_all_reduce``
passes each rank's through, a ``cp_all_gather``'s gradient is reduce-scattered, ...), so autograd gives each rank's
gradients as the job would compute them. Floating values run in float64 (``_float64``).

The verifications (``split/verify.py`` for tp, ``verify_cp.py``, ``verify_ep.py``) feed it inputs and compare what
it computes against the unsharded graphs; ``plan_cost``'s tests meter its collectives."""
from __future__ import annotations

import torch
import torch.fx as fx

from tracepp.runtime import context_parallel as cp_runtime
from tracepp.runtime import tensor_parallel as tp_runtime

TP = torch.ops.tracepp


class NotVerified(Exception):
    """The stage could not be run here (too big, an op this interpreter does not know, random ops)."""



# ---- the collectives across the ranks' values

def _pieces(t, dim, groups, size):
    shape = list(t.shape)
    return t.reshape(shape[:dim] + [groups, shape[dim] // groups] + shape[dim + 1:])


def _piece(t, dim, groups, size, rank):
    """Rank ``rank``'s piece of ``dim`` (of each of its ``groups`` segments): ``_local_piece``."""
    shape = list(t.shape)
    shape[dim] //= size
    return _pieces(t, dim, groups, size).chunk(size, dim=dim + 1)[rank].reshape(shape)


def _join(parts, dim, groups):
    """The ranks' pieces joined along ``dim``, each segment's pieces side by side: ``_gather``."""
    if groups == 1:
        return torch.cat(parts, dim=dim)
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    return torch.cat([_pieces(p, dim, groups, len(parts)) for p in parts], dim=dim + 1).reshape(shape)


def _sum(values):
    out = values[0]
    for v in values[1:]:
        out = out + v
    return out


class _Across(torch.autograd.Function):
    """One collective over the ranks' values: ``forward(list) -> list`` and the runtime's ``backward(list) -> list``."""

    @staticmethod
    def forward(ctx, forward, backward, *values):
        ctx.backward = backward
        outs = forward(list(values))
        ctx.like = [(o.shape, o.dtype) for o in outs]
        fresh, seen = [], set()  # each output a tensor of its own (not an input, not another output)
        for o in outs:
            fresh.append(o.clone() if id(o) in seen or o._is_view() or any(o is v for v in values) else o)
            seen.add(id(o))
        return tuple(fresh)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype) for g, (shape, dtype) in zip(grads, ctx.like)]
        with torch.no_grad():
            return (None, None, *ctx.backward(grads))


def _across(values, forward, backward):
    return list(_Across.apply(forward, backward, *values))


def _collective(target, values, args, size):
    """``target`` over the ranks: ``values`` is the list of the ranks' first operands, ``args`` the rest."""
    ranks = range(size)
    if target is TP.tp_copy.default:
        return _across(values, lambda xs: [x.clone() for x in xs], lambda gs: [_sum(gs)] * size)
    if target is TP.tp_all_reduce.default:
        return _across(values, lambda xs: [_sum(xs)] * size, lambda gs: list(gs))
    dim = args[0] if args else None
    if target in (TP.tp_all_gather.default, TP.tp_scatter.default, TP.sp_all_gather.default,
                  TP.sp_reduce_scatter.default):
        groups = args[1] if len(args) > 1 else 1
        if target is TP.tp_all_gather.default:
            return _across(values, lambda xs: [_join(xs, dim, groups)] * size,
                           lambda gs: [_piece(g, dim, groups, size, r) for r, g in zip(ranks, gs)])
        if target is TP.tp_scatter.default:
            return _across(values, lambda xs: [_piece(x, dim, groups, size, r) for r, x in zip(ranks, xs)],
                           lambda gs: [_join(gs, dim, groups)] * size)
        if target is TP.sp_all_gather.default:
            return _across(values, lambda xs: [_join(xs, dim, groups)] * size,
                           lambda gs: [_piece(_sum(gs), dim, groups, size, r) for r in ranks])
        return _across(values, lambda xs: [_piece(_sum(xs), dim, groups, size, r) for r in ranks],
                       lambda gs: [_join(gs, dim, groups)] * size)
    if target is TP.tp_piece.default:  # backward: each rank's gradient piece in its place, zeros elsewhere
        groups = args[1] if len(args) > 1 else 1

        def placed(g, r):
            parts = [g if k == r else torch.zeros_like(g) for k in ranks]
            return _join(parts, dim, groups)

        return _across(values, lambda xs: [_piece(x, dim, groups, size, r) for r, x in zip(ranks, xs)],
                       lambda gs: [placed(g, r) for r, g in zip(ranks, gs)])
    if target is TP.tp_head_group.default:
        parts = args[1]

        def placed(g, r, shape):
            full = g.new_zeros(shape)
            full.chunk(parts, dim=dim)[r * parts // size].copy_(g)
            return full

        shapes = [v.shape for v in values]
        return _across(values, lambda xs: [x.chunk(parts, dim=dim)[r * parts // size].clone() for r, x in zip(ranks, xs)],
                       lambda gs: [_sum([placed(g, r, s) for r, g, s in zip(ranks, gs, shapes)])] * size)
    if target is TP.tp_amax.default:  # the maximum of the ranks' maxima; backward the runtime's (amax_gradient)
        dims, keepdim = args[0], args[1] if len(args) > 1 else False
        kept = []

        def forward(xs):
            out = torch.stack([x.amax(dims, keepdim) for x in xs]).amax(0)
            kept.extend([xs, out])
            return [out] * size

        def backward(gs):
            xs, out = kept
            shaped = out
            if not keepdim:
                for d in sorted(d % xs[0].dim() for d in dims):
                    shaped = shaped.unsqueeze(d)
            total = _sum([(x == shaped).sum(dims, keepdim=True).to(gs[0].dtype) for x in xs])
            return [tp_runtime.amax_gradient(g, x, out, dims, keepdim, lambda _count: total) for g, x in zip(gs, xs)]

        return _across(values, forward, backward)
    if target is TP.tp_parts.default:
        segments = list(args[1])
        return _across(values, lambda xs: [tp_runtime.shard(x, dim, size, r, segments) for r, x in zip(ranks, xs)],
                       lambda gs: [tp_runtime.original_layout(torch.cat(gs, dim=dim), dim, size, segments)] * size)
    raise NotVerified(f"{target} has no simulation here")


_COLLECTIVES = {"tp_copy", "tp_all_reduce", "tp_all_gather", "tp_scatter", "tp_piece", "sp_all_gather",
                "sp_reduce_scatter", "tp_head_group", "tp_parts", "tp_amax"}


class _Ranks:
    """The runtimes' ``_STATE`` set to one rank (the local ops read it): tp rank ``rank`` of ``size``
    (``tp_owned_split``, the vocabulary lookup's rows) and cp rank ``cp_rank`` of ``cp`` (``cp_shard``,
    ``cp_positions``)."""

    def __init__(self, size: int, rank: int, cp: int = 1, cp_rank: int = 0):
        self.size, self.rank, self.cp, self.cp_rank = size, rank, cp, cp_rank

    def __enter__(self):
        self.old = dict(tp_runtime._STATE), dict(cp_runtime._STATE)
        tp_runtime._STATE.update(size=self.size, rank=self.rank, group=None)
        cp_runtime._STATE.update(size=self.cp, rank=self.cp_rank, group=None, record=False)

    def __exit__(self, *exc):
        for state, old in zip((tp_runtime._STATE, cp_runtime._STATE), self.old):
            state.clear()
            state.update(old)


# ---- context parallelism's collectives: 2 cp chunks per sequence, rank r holding chunks r and 2cp-1-r

def _cp_piece(t, dim, groups, cp, rank):
    """Rank ``rank``'s chunks of ``dim``: the runtime's own cut (``cp_shard``)."""
    with _Ranks(1, 0, cp, rank):
        return cp_runtime._shard(t, dim, groups)


def _cp_join(parts, dim, groups):
    """The ranks' chunks joined in sequence order (the runtime's ``_joined``): chunk c < cp is rank c's first,
    chunk c >= cp rank 2cp-1-c's second."""
    cp, shape = len(parts), list(parts[0].shape)
    if cp == 1:
        return parts[0]
    views = [p.reshape(shape[:dim] + [groups, 2, shape[dim] // (2 * groups)] + shape[dim + 1:]) for p in parts]
    ordered = [views[c].narrow(dim + 1, 0, 1) for c in range(cp)]
    ordered += [views[2 * cp - 1 - c].narrow(dim + 1, 1, 1) for c in range(cp, 2 * cp)]
    shape[dim] *= cp
    return torch.cat(ordered, dim=dim + 1).reshape(shape)


def _heads_summed(g, repeats, head_dim):
    if repeats == 1:
        return g
    shape = list(g.shape)
    return g.reshape(shape[:head_dim] + [shape[head_dim] // repeats, repeats] + shape[head_dim + 1:]).sum(head_dim + 1)


def _cp_collective(target, values, args, cp):
    """A cp collective over the cp ranks' values, forward and the runtime's backward (an all-gather's gradient
    reduce-scattered, a reduce-scatter's all-gathered, an all-reduce's all-reduced)."""
    ranks = range(cp)
    if target is TP.cp_all_reduce.default:
        return _across(values, lambda xs: [_sum(xs)] * cp, lambda gs: [_sum(gs)] * cp)
    if target is TP.cp_amax.default:  # the maximum over the ranks' positions joined (in any order: a maximum),
        dims, keepdim = args[0], args[1] if len(args) > 1 else False  # through amax's own gradient
        out = torch.cat(values, dim=dims[0]).amax(dims, keepdim)
        return [out] * cp
    dim, groups = args[0], args[1] if len(args) > 1 else 1
    if target is TP.cp_all_gather.default:
        repeats, head = (args[2], args[3]) if len(args) > 3 else (1, 0)

        def gather(xs):
            whole = _cp_join(xs, dim, groups)
            return [whole.repeat_interleave(repeats, dim=head) if repeats > 1 else whole] * cp
        return _across(values, gather, lambda gs: [_cp_piece(_sum([_heads_summed(g, repeats, head) for g in gs]),
                                                             dim, groups, cp, r) for r in ranks])
    if target is TP.cp_reduce_scatter.default:
        return _across(values, lambda xs: [_cp_piece(_sum(xs), dim, groups, cp, r) for r in ranks],
                       lambda gs: [_cp_join(gs, dim, groups)] * cp)
    if target is TP.cp_halo.default:  # the runtime's own: each rank's tails, the all-gather simulated, assembled
        left = args[1]
        tails = []
        for r in ranks:
            with _Ranks(1, 0, cp, r):
                tails.append(cp_runtime.halo_tails(values[r], dim, left))
        joined = _cp_collective(TP.cp_all_gather.default, tails, [dim], cp)
        return [cp_runtime.halo_assemble(values[r], joined[r], dim, left, cp, r) for r in ranks]
    if target in (TP.cp_cumsum.default, TP.cp_logcumsumexp.default, TP.cp_cumprod.default):  # the runtime's own,
        kind = target.name().split("::cp_")[1]  # the all-gather simulated
        scanned = [cp_runtime.scan_chunks(values[r], dim, kind) for r in ranks]
        joined = _cp_collective(TP.cp_all_gather.default, [totals for _parts, totals in scanned], [dim], cp)
        return [cp_runtime.scan_assemble(scanned[r][0], joined[r], dim, kind, cp, r) for r in ranks]
    if target is TP.cp_linear_scan.default:  # the runtime's own, the all-gather of the chunks' totals simulated
        b, dim = args[0], args[1]  # (b: each rank's)
        scanned = [cp_runtime.linear_scan_chunks(values[r], b[r], dim) for r in ranks]
        joined = _cp_collective(TP.cp_all_gather.default, [totals for _s, _p, totals in scanned], [0], cp)
        return [cp_runtime.linear_scan_assemble(states, products, joined[r], dim, cp, r)
                for r, (states, products, _t) in zip(ranks, scanned)]
    raise NotVerified(f"{target} has no simulation here")


_CP_COLLECTIVES = {"cp_all_gather", "cp_reduce_scatter", "cp_all_reduce", "cp_amax", "cp_halo", "cp_cumsum",
                   "cp_logcumsumexp", "cp_cumprod", "cp_linear_scan"}
_LOCAL = {"tp_owned_split", "tp_owned_select", "cp_shard", "cp_positions", "tp_vocab_rows",  # read the rank from
          "cp_unhalo"}                                                                         # _STATE, or none


def _float64(item):
    """A dtype argument read at double precision: every floating dtype as float64, every complex one as
    complex128 (a rotary table of complex numbers: DeepSeek-V2, torchtitan)."""
    if isinstance(item, torch.dtype) and item.is_floating_point:
        return torch.float64
    if isinstance(item, torch.dtype) and item.is_complex:
        return torch.complex128
    return item


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm`` in float64, which torch's kernel does not take: one ``mm`` per group of rows (a 2-D
    ``mat_a`` by a 3-D ``mat_b`` with offsets, as routed experts call it), rows past the last offset zero."""
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None or bias is not None:
        raise NotVerified("aten._grouped_mm other than rows by a 3-D weight with offsets has no float64 simulation")
    from tracepp.runtime.expert_parallel import _loop_grouped_mm

    return _loop_grouped_mm(mat_a, mat_b, offs)


_FLOAT64_OPS = {torch.ops.aten._grouped_mm.default: _grouped_mm}  # ops whose kernels take no float64


def run(g: fx.Graph, inputs: list, size: int, cp: int = 1, extra: dict = None) -> dict:
    """Interpret ``g`` with every value a list of ``size x cp`` per-rank values (tp rank t of cp rank c at
    ``c * size + t``: each collective over its own group); ``inputs``: per placeholder such a list. ``extra``: tracepp
    op name -> ``simulate(node, at) -> list`` for ops simulated elsewhere (``at(r)``: a node's rank-r value; the
    expert-parallel ops, ``split/verify_ep.py``). Returns {node name: list}. An op that raises carries its node and
    the values so far (``verify_node``, ``verify_env``)."""
    env: dict = {}
    placeholders = iter(inputs)
    count = size * cp
    tp_groups = [list(range(c * size, (c + 1) * size)) for c in range(cp)]
    cp_groups = [list(range(t, count, size)) for t in range(size)]

    def at(rank):
        def one(item):
            if isinstance(item, fx.Node):
                return env[item.name][rank]
            return _float64(item)
        return one

    def over(groups, each):
        outs = [None] * count
        for group in groups:
            for index, value in zip(group, each(group)):
                outs[index] = value
        return outs

    for node in g.nodes:
        try:
            _step(node, env, at, over, placeholders, size, cp, tp_groups, cp_groups, extra or {})
        except Exception as error:
            if not hasattr(error, "verify_node"):
                error.verify_node, error.verify_env = node, env
            raise
    return env


def _step(node, env, at, over, placeholders, size, cp, tp_groups, cp_groups, extra) -> None:
    count = size * cp
    if node.op == "placeholder":
        env[node.name] = next(placeholders)
    elif node.op == "output":
        env[node.name] = [fx.node.map_aggregate(node.args[0], at(r)) for r in range(count)]
    elif node.op == "call_function":
        target = node.target
        if target is torch.ops.aten._assert_tensor_metadata.default:  # computes nothing; its device is the
            env[node.name] = [None] * count                             # trace's (meta for the loss), dropped as
            return                                                      # the rank scripts drop it (stage_code)
        name = getattr(target, "namespace", None) == "tracepp" and target.name().split("::")[-1].split(".")[0]
        if name in extra:
            env[node.name] = extra[name](node, at)
            return
        if name in _COLLECTIVES:
            env[node.name] = over(tp_groups, lambda group: _collective(
                target, [env[node.args[0].name][r] for r in group], list(node.args[1:]), size))
            return
        if name in _CP_COLLECTIVES:
            env[node.name] = over(cp_groups, lambda group: _cp_collective(
                target, [env[node.args[0].name][r] for r in group],
                [[env[a.name][r] for r in group] if isinstance(a, fx.Node) else a for a in node.args[1:]], cp))
            return
        if name == "tp_vocab_embedding":
            weight, ids, padding = node.args[:3]
            reduce = node.args[3] if len(node.args) > 3 else True
            outs = []
            for r in range(count):
                with _Ranks(size, r % size, cp, r // size):
                    outs.append(target(env[weight.name][r], env[ids.name][r], padding, False))
            env[node.name] = over(tp_groups, lambda group: _collective(
                TP.tp_all_reduce.default, [outs[r] for r in group], [], size)) if reduce else outs
            return
        if name and name not in _LOCAL:
            raise NotVerified(f"{target} has no simulation here")
        target = _FLOAT64_OPS.get(target, target)
        outs = []
        for r in range(count):
            args = fx.node.map_aggregate(node.args, at(r))
            kwargs = fx.node.map_aggregate(node.kwargs, at(r))
            if not name:  # not tracepp's: reads no runtime's rank
                outs.append(target(*args, **kwargs))
                continue
            with _Ranks(size, r % size, cp, r // size):
                outs.append(target(*args, **kwargs))
        env[node.name] = outs
    else:
        raise NotVerified(f"a {node.op} node ({node.name}) has no simulation here")
