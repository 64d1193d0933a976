"""Where a row-wise linear's partial sums are summed: not always right after it. DTensor's ``Partial(sum)``
placement, carried through the ops that are linear in it.

A row-wise linear leaves each tp rank a partial sum of its output, all-reduced after it (Megatron's ``g``: the
all-reduce forward, identity backward). Where what reads the partial sums is linear in them, the all-reduce can
wait: a view, a transpose, a cast, a sum over a dim, a product with a whole value (one that carries a gradient
then takes a part of it on each rank, summed by a ``tp_copy``), the sum of two partial values, rows picked at whole
indices and written into partial sums (a fresh value of zeros is one: each rank's 0). Llama 4's MoE computes every
expert on every token (a ``bmm`` of ``[experts, tokens, hidden]``, row-wise on the experts' features), sums over the
experts and adds the shared expert (row-wise too): summed where each is made, three all-reduces, one of them
``experts`` times the layer's ``[b, s, h]``; summed where they meet, one all-reduce of ``[b, s, h]``, as Megatron's
plan moves. Experts called one by one (litgpt's ``LLaMAMoE``: ``y[token_idx] += probs * expert(x[token_idx])``)
likewise: ``top_k`` times the tokens' rows, or one ``[b, s, h]``.

:func:`defer` is a pass over a settled walk: it places nothing, it moves all-reduces. A value made of partial
sums (a row-wise output, or an op above whose every reading of them is of partial values) stays
partial where every op that reads it takes partial sums, and is all-reduced where it is made otherwise. Each run
of such values is kept only where the bytes it all-reduces are fewer than the row-wise outputs' own; under
sequence parallelism (a reduce-scatter, not an all-reduce) nothing moves. A deferred linear's bias is added
as 1/tp of it on every rank (through ``tp_copy`` where it takes a gradient: each rank's is 1/tp of the whole),
so the partial sums add up to it once. The rewrite skips the deferred
linears' all-reduces and puts one after each value in ``late_sums``; ``verify`` compares nothing held partial.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.cost import tensor_bytes

aten = torch.ops.aten
_SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}  # linear in their input
_ADDS = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}  # partial + partial
_SCALES = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default}  # by a whole value
_ZEROS = {aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default}  # partial sums of nothing: 0 each
_PUTS = {aten.index_put_.default, aten.index_put.default}  # rows written at indices: linear in both


def _zeros(node, walk) -> bool:
    """A value of zeros made fresh (``y = torch.zeros_like(x)``, rows of experts' outputs added into it): held as
    partial sums, each rank's 0. (It carries a gradient once what is written into it does: not a reason to sum.)"""
    return node.op == "call_function" and node.target in _ZEROS and not walk.on_shards(node)


def _whole_indices(node, partial: set, walk) -> bool:
    indices = [a for a in (node.args[1] if len(node.args) > 1 else []) if isinstance(a, fx.Node)]
    return not any(a in partial or a in walk.shard or rules.val(a).dtype.is_floating_point for a in indices)


def _scaled_by(node, partial: set) -> list:
    """The whole tensors a scale multiplies its partial operand by (a product's other factor, either side)."""
    return [a for a in node.all_input_nodes if isinstance(rules.val(a), torch.Tensor) and a not in partial]


def _identity(node) -> bool:
    """A dropout that drops nothing (``p`` 0, or not training: GPT-NeoX's, GPT-J's and Phi's ``dropout(x, 0.0)``).
    One that drops would draw a different mask on each rank: not linear in the sum."""
    if node.target not in (aten.dropout.default, aten.feature_dropout.default):
        return False
    p, train = rules.arg(node, 1, "p", 0.5), rules.arg(node, 2, "train", True)
    return p == 0 or not train


def _carries(node, partial: set, walk) -> bool:
    """``node`` computes partial sums from partial sums: every tensor it reads that is partial it reads linearly,
    and the rest are whole values that carry no gradient (or plain numbers) it only scales by."""
    if node.op != "call_function" or walk.on_shards(node) or node in walk.roles or node in walk.sums:
        return False
    target = node.target
    tensors = [a for a in node.all_input_nodes if isinstance(rules.val(a), torch.Tensor)]
    mine = [a for a in tensors if a in partial]
    if not mine or any(a in walk.shard for a in tensors):
        return False
    if target in rules.KEEP or target in rules.VIEWS or target in rules.FLATTENS or target in rules.UNFLATTENS \
            or target in rules.MOVES or target in rules.EXPANDS or target in _SUMS:
        return tensors == [node.args[0]] and (target not in rules.DROPOUTS or _identity(node))
    if target in _ADDS:
        if mine == tensors == [node.args[0]] and len(node.args) > 1 and not isinstance(node.args[1], fx.Node):
            return node.args[1] == 0  # + 0: Python's sum() of the experts' outputs starts from it
        return len(tensors) == 2 and len(mine) == 2 and node.kwargs.get("alpha", 1) == 1
    if target in _SCALES:  # partial times a whole value: where that carries a gradient (a router's weight of each
        #                    expert's rows), its gradient is a part on each rank, summed by a tp_copy (:func:`defer`)
        first = node.args[0]
        return len(mine) == 1 and (first in partial or target in (aten.mul.Tensor, aten.mul.Scalar))
    if target is aten.index.Tensor:  # rows picked at whole indices
        return mine == [node.args[0]] and _whole_indices(node, partial, walk)
    if target in _PUTS:  # rows of partial sums written into partial sums (litgpt's y[token_idx] += expert(...))
        values = node.args[2] if len(node.args) > 2 else None
        return node.args[0] in partial and values in partial and _whole_indices(node, partial, walk)
    return False


def defer(walk) -> None:
    """Set ``walk.deferred`` (row-wise linears whose all-reduce is not right after them), ``walk.late_sums``
    (values all-reduced right after them instead) and ``walk.partial`` (every value the rewritten program holds as
    partial sums: the deferred linears, the values between, the late sums before their all-reduce)."""
    walk.deferred, walk.late_sums, walk.partial = set(), {}, set()
    starts = {n for n, role in walk.roles.items() if role == "rowwise" and n not in walk.reduce_scatters
              and isinstance(rules.val(n), torch.Tensor)}
    if not starts:
        return
    zeros = {n for n in walk.graph.nodes if _zeros(n, walk)}
    partial = starts | zeros
    order = {node: index for index, node in enumerate(walk.graph.nodes)}
    first = min(order[n] for n in starts)
    for node in walk.graph.nodes:  # what partial sums reach: forward, in graph order
        if order[node] > first and _carries(node, partial, walk):
            partial.add(node)
    while True:  # kept partial only where every reader takes partial sums (the rest are summed where made)
        carried = {n for n in partial if n.users and all(u in partial for u in n.users)}
        dropped = {n for n in partial if n not in starts and (n in zeros and n not in carried or n not in zeros and not (
            _carries(n, partial, walk) and all(a in carried for a in n.all_input_nodes if a in partial)))}
        if not dropped:
            break
        partial -= dropped
    for run in _runs(sorted(partial, key=order.get)):  # each connected run kept where it all-reduces fewer bytes
        summed = [n for n in run if n not in carried]
        if not any(s in carried for s in run if s in starts):
            continue
        biases = [walk.forms[s][2] for s in run if s in starts and s in carried and walk.forms[s][2] is not None]
        scales = [(n, a) for n in run if n.target in _SCALES for a in _scaled_by(n, partial) if walk.needs_grad.get(a)]
        added = sum(tensor_bytes(rules.val(b)) for b in biases if walk.needs_grad.get(b))  # their gradients summed
        added += sum(2 * tensor_bytes(rules.val(a)) for _n, a in scales)  # (and the scales', all-reduced backward)
        if sum(tensor_bytes(rules.val(n)) for n in summed) + added >= sum(tensor_bytes(rules.val(s)) for s in run
                                                                          if s in starts):
            continue
        walk.copies.extend(pair for pair in scales if pair not in walk.copies)
        walk.deferred.update(s for s in run if s in starts and s in carried)
        walk.late_sums.update((n, None) for n in summed if n not in starts)  # a start summed where made: as before
        walk.partial.update(run)


def _runs(partial: list) -> list:
    """The connected runs of partial values (joined where one reads another), in the order ``partial`` gives."""
    inside = set(partial)
    return rules.components(partial, ((arg, node) for node in partial for arg in node.all_input_nodes
                                      if arg in inside))
