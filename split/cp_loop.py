"""A loop over the positions of a sequence, unrolled by the trace, under context parallelism.

Mamba's reference scan (mambapy's ``selective_scan_seq``, transformers' slow path, mamba-minimal) is a Python loop
over the positions: step ``t`` reads position ``t`` of tensors that carry the sequence (``deltaA[:, t]``), carries a
state from step to step (``h = deltaA[:, t] * h + BX[:, t]``) and appends its output, and the outputs are stacked
into a sequence again (``torch.stack(hs, dim=1)``). The trace unrolls it: ``L`` copies of the step, one per position,
each reading its position with ``select(x, dim, t)``.

Under cp a rank holds ``L / cp`` positions (chunks ``r`` and ``2 cp - 1 - r``), in its own order along the same dim.
Each step reads only its own position, so a rank runs the first ``L / cp`` steps on its local tensors (``select(x,
dim, t)`` is then its ``t``-th position, and the stack its positions in its order) and the other steps are dropped.
What crosses positions is the state: where it is a first-order linear recurrence, ``h[t] = a[t] * h[t - 1] + b[t]``
from a zero state, its steps' ``a`` and ``b`` are stacked and the states computed at once by ``cp_linear_scan`` (each
chunk from zero, then the state entering it from the chunks before, ``runtime/context_parallel.py``), and each step
reads its state from there. A loop whose state is carried any other way, or whose steps read more than their own
position, is not one (its ops run on the whole sequence, as an op no rule places).

:func:`find` reads the loops off the graph before the walk (by structure alone); the cp walk accepts one where every
position it reads is of a sequence shard on that dim (``cp_walk._Walk._position_loop``), and ``cp_rewrite`` rewrites
it (:func:`rewrite`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.rules import val as _val

aten = torch.ops.aten
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


@dataclass(eq=False)
class PositionLoop:
    stack: fx.Node  # the steps' outputs stacked into a sequence
    steps: int
    reads: dict  # select node -> (the tensor it reads a position of, its dim, the step)
    step_of: dict  # node of a step -> its step
    chain: list = field(default_factory=list)  # per step [mul, add, a, b, cast] of h = a * h_before + b (cast: the
    #                                            add cast to its own dtype, which the next step reads); empty: none
    start: fx.Node = None  # the zero state before step 0

    def record(self) -> tuple:
        """What the rewrite needs, as plain data of nodes (a walk's records are mapped onto repeated blocks):
        (steps, chain, start, the steps' nodes)."""
        return self.steps, tuple(tuple(step) for step in self.chain), self.start, tuple(self.step_of)


def find(graph: fx.Graph) -> list:
    """The position loops of ``graph``: each stack of ``L`` values, value ``t`` made by step ``t`` alone (ops that
    read position ``t`` of tensors ``L`` long on that dim, values no step made, and at most the state of step
    ``t - 1``). The trace emits the steps in order, so each loop is read off the stretch of the graph that ends at its
    stack and begins a step before its first output (a loop inside another, over heads, is found as well)."""
    nodes = list(graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    loops = []
    for stack in nodes:
        if stack.op != "call_function" or stack.target is not aten.stack.default:
            continue
        outs = stack.args[0]
        if len(outs) < 2 or not all(isinstance(out, fx.Node) and out in position for out in outs):
            continue
        first, second = position[outs[0]], position[outs[1]]
        if second <= first:
            continue
        loop = _loop(stack, *_steps(nodes[max(0, 2 * first - second - 8):position[stack]], len(outs)))
        if loop is not None:
            loops.append(loop)
    return loops


def _steps(stretch: list, steps: int) -> tuple:
    """(node -> its step, read -> (tensor, dim, step), node -> the earlier step it also reads) over ``stretch``: a
    ``select(x, dim, t)`` of a tensor ``steps`` long on ``dim`` that no step made is step ``t``'s read of position
    ``t``; an op of one step's values (and values of no step) is that step's; of two steps' in a row, the later's."""
    step_of: dict = {}
    reads: dict = {}
    mixed: dict = {}
    for node in stretch:
        if node.op != "call_function":
            continue
        if (node.target is aten.select.int and isinstance(node.args[2], int) and node.args[0] not in step_of
                and 0 <= node.args[2] < steps):
            src, dim = node.args[0], node.args[1] % _val(node.args[0]).dim()
            if rules.ints([_val(src).shape[dim]]) and int(_val(src).shape[dim]) == steps:
                reads[node] = (src, dim, node.args[2])
                step_of[node] = node.args[2]
                continue
        found = {step_of[a] for a in node.all_input_nodes if a in step_of}
        if found and max(found) - min(found) <= 1:  # (a value of several steps, a stack of them, belongs to none)
            step_of[node] = max(found)
            if len(found) > 1:
                mixed[node] = min(found)
    return step_of, reads, mixed


def _loop(stack, step_of: dict, reads: dict, mixed: dict):
    outs = stack.args[0]
    if len(outs) < 2 or any(step_of.get(out) != t for t, out in enumerate(outs)):
        return None
    steps = len(outs)
    mine, todo = {}, list(outs)  # the steps' values the outputs are made from
    while todo:
        n = todo.pop()
        if n not in mine and n in step_of:
            mine[n] = step_of[n]
            todo.extend(n.all_input_nodes)
    if any(t - 1 != mixed[n] for n, t in mine.items() if n in mixed):
        return None  # a step reads a step other than the one just before it
    chain = _chain(mine, mixed, steps)
    if chain is None:
        return None
    allowed = {(step[4] or step[1]): chain[t + 1][0] for t, step in enumerate(chain[:-1])}  # a state read by the
    ignored = {}                                                                           # next step's mul
    for n, t in mine.items():
        if n.target is not aten.select.int and isinstance(n.target, torch._ops.OpOverload) and (
                n.target._schema.is_mutable):
            return None
        for user in n.users:
            if user.target in rules.IGNORED:  # (export's metadata asserts: dropped with what they check)
                ignored[user] = t
            elif not (user is stack or (mine.get(user) == t) or allowed.get(n) is user):
                return None  # read outside its step (by a later op, another step, the output)
    loop = PositionLoop(stack, steps, {n: reads[n] for n in mine if n in reads}, {**mine, **ignored}, chain)
    if chain:
        mul = chain[0][0]
        loop.start = next(a for a in mul.args if a is not chain[0][2])
    return loop


def _chain(mine: dict, mixed: dict, steps: int):
    """Per step ``[mul, add, a, b, cast]`` of a state ``h = a * h_before + b`` (``h_before``: the zero state at step 0), []
    where no step reads the step before it, None where one reads it otherwise."""
    carried = [n for n in mine if n in mixed]
    if not carried:
        return []
    if len(carried) != steps - 1:
        return None
    chain = [None] * steps
    before = {}  # step -> the state the next step reads (its add, or a cast of it to the dtype it has)
    for mul in carried:
        t = mine[mul]
        if mul.target is not aten.mul.Tensor or len(mul.all_input_nodes) != 2 or len(_users(mul)) != 1:
            return None
        read = next((a for a in mul.args if isinstance(a, fx.Node) and mine.get(a) == t - 1), None)
        a = next((x for x in mul.args if x is not read), None)
        add = _users(mul)[0]
        if read is None or not isinstance(a, fx.Node) or mine.get(a) != t or not _state(add, mul, mine, t):
            return None
        before[t - 1] = read
        chain[t] = [mul, add, a, _other(add, mul), None]
    h0 = _uncast(before[0])
    mul0 = next((m for m in h0.args if isinstance(m, fx.Node) and m.target is aten.mul.Tensor), None)
    if mul0 is None or not _state(h0, mul0, mine, 0) or len(_users(mul0)) != 1:
        return None
    zero = [a for a in mul0.args if isinstance(a, fx.Node) and a not in mine]
    a0 = [a for a in mul0.args if isinstance(a, fx.Node) and mine.get(a) == 0]
    if len(zero) != 1 or len(a0) != 1 or zero[0].target not in _ZEROS:
        return None
    chain[0] = [mul0, h0, a0[0], _other(h0, mul0), None]
    for t in range(steps - 1):  # each state is the one the next step carries on (or its cast to its own dtype)
        if _uncast(before[t]) is not chain[t][1]:
            return None
        if before[t] is not chain[t][1]:
            chain[t][4] = before[t]
    shapes = {tuple(_val(n).shape) for step in chain for n in step[2:4]} | {tuple(_val(step[1]).shape) for step in chain}
    if len({len(s) for s in shapes}) != 1:
        return None  # a and b with the state's dims (broadcast within them)
    return chain


def _users(node) -> list:
    return [u for u in node.users if u.target not in rules.IGNORED]


def _uncast(node):
    """``node``, or what it casts to the dtype it already has (``ssm_state.to(dtype)``, which export records as an
    alias that later reads of the state go through)."""
    if (node.target in rules.CASTS and isinstance(node.args[0], fx.Node)
            and _val(node).dtype == _val(node.args[0]).dtype and _val(node).shape == _val(node.args[0]).shape):
        return node.args[0]
    return node


def _state(add, mul, mine: dict, t: int) -> bool:
    """``add`` is ``mul + b`` (either order) with ``b`` of step ``t``."""
    if add.target is not aten.add.Tensor or len(add.args) != 2 or mul not in add.args or add.kwargs.get("alpha", 1) != 1:
        return False
    b = _other(add, mul)
    return isinstance(b, fx.Node) and mine.get(b) == t


def _other(node, one):
    return node.args[1] if node.args[0] is one else node.args[0]


def rewrite(g: fx.Graph, stack, record: tuple, kept: int, insert, cp_scan) -> list:
    """Rewrite an accepted loop (its ``stack`` and :meth:`PositionLoop.record`) for this rank's ``kept`` positions:
    the stack reads the first ``kept`` steps' outputs; a state chain is computed by ``cp_scan`` (``cp_linear_scan``
    over the steps' ``a`` and ``b`` stacked on dim 0) and each kept step reads its state from there.
    ``insert(before, target, args, val, like)`` makes a node. Returns the nodes left unread (the dropped steps, the
    old state chain), to erase."""
    _steps, chain, start, nodes = record
    stack.args = (list(stack.args[0][:kept]),) + tuple(stack.args[1:])
    if chain:
        steps = chain[:kept]
        last = max((n for step in steps for n in step[2:4]), key=_position(g))
        anchor = last.next
        a = insert(anchor, aten.stack.default, [[s[2] for s in steps], 0],
                   torch.stack(torch.broadcast_tensors(*[_val(s[2]) for s in steps])), stack)
        b = insert(anchor, aten.stack.default, [[s[3] for s in steps], 0],
                   torch.stack(torch.broadcast_tensors(*[_val(s[3]) for s in steps])), stack)
        shape = torch.broadcast_shapes(_val(a).shape, _val(b).shape)
        h = insert(anchor, cp_scan, [a, b, 0], _val(a).new_empty(shape), stack)
        for t, (_mul, add, _a, _b, cast) in enumerate(steps):
            state = insert(anchor, aten.select.int, [h, 0, t], _val(add), add)
            carried = chain[t + 1][0] if t + 1 < len(chain) else None
            for node in (add, cast) if cast is not None else (add,):
                for user in list(node.users):
                    if user is not carried and user is not cast and user.target not in rules.IGNORED:
                        user.replace_input_with(node, state)
        _legalize(g)
    order = _position(g)
    return sorted((n for n in nodes if n.graph is g), key=order) + ([start] if start is not None else [])


def _position(g: fx.Graph):
    index = {n: i for i, n in enumerate(g.nodes)}
    return lambda n: index.get(n, -1)


def _legalize(g: fx.Graph) -> None:
    """Order ``g``'s nodes so that each comes after its inputs, moving as few as the original order allows (a kept
    step's ops that read its state now come after the states are computed from every kept step's ``a`` and ``b``)."""
    order, done = [], set()
    for node in list(g.nodes):
        todo = [(node, False)]
        while todo:
            n, expanded = todo.pop()
            if n in done:
                continue
            if expanded:
                done.add(n)
                order.append(n)
                continue
            todo.append((n, True))
            todo.extend((a, False) for a in reversed(n.all_input_nodes) if a not in done)
    current = None
    for n in order:
        if n.op == "placeholder":
            current = n
            continue
        if current is None:
            current = n
            continue
        if current.next is not n:
            current.append(n)
        current = n
