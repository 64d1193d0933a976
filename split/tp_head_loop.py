"""A loop over heads, unrolled by the trace: the same ops run on every head's slices, one head after the other,
and the heads' results are joined again (transformers' Zamba: ``for head_idx in range(self.n_mamba_heads)``, each
head's selective scan on ``hidden_states_B_C[head_idx]``, ``B[head_idx]``, ``C[head_idx]``, ``A[head_idx]``,
``self.D[head_idx]``, then ``torch.cat`` of their outputs; attention run head by head, ``sdpa(q[:, h], k[:, h],
v[:, h])`` joined by ``torch.stack``).

Found on the graph alone (:func:`find`), before any placement: the values whose heads are taken one by one (a
``select`` of each index of one dim, each once), the ops each head's selects reach (a head's *chain*: an op that
reads two heads' values is no chain's), and the ``cat`` or ``stack`` joining the chains' results in head order. Every
chain must be the same ops as the first, reading the same values outside the loop and its own head of each value
selected, and must write nothing in place.

Under tensor parallelism (``tp_walk._Walk._enter_loop``) where the heads are sharded (``heads / tp`` on each rank,
in order), a rank runs the first ``heads / tp`` chains on its own heads: local head ``h`` is global head
``rank * heads / tp + h``, a value every rank holds whole is read at the rank's piece before its head is taken, and
the other chains are dropped. The join of the chains kept is the rank's piece of the joined value, sharded as the
heads were. Every rank computes 1/tp of the loop, where a plan without it gathers the heads and runs all of them.
"""
from __future__ import annotations

import collections
import weakref

import torch
import torch.fx as fx

from tracepp.split.rules import arg as _arg, equal as _equal, val as _val

aten = torch.ops.aten
_JOINS = (aten.cat.default, aten.stack.default)


class Loop:
    """One loop over ``heads`` heads: ``taken`` {value: the dim its heads are selected from}; ``chains`` per head
    its ops in graph order (``selects``: the selects of ``taken`` values among them, by (value, head));
    ``joins`` {join: the output dim holding the heads}; ``first``: the earliest op of the loop in graph order."""

    def __init__(self, heads: int, taken: dict, chains: list, selects: dict, joins: dict, first):
        self.heads, self.taken, self.chains, self.selects, self.joins, self.first = (
            heads, taken, chains, selects, joins, first)


_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> (its shape when searched, loops)


def find(graph: fx.Graph) -> dict:
    """{the earliest op of a loop: its :class:`Loop`} for every loop over heads in ``graph`` (searched once per graph:
    a plan walks the same graphs many times)."""
    nodes = graph.nodes
    shape = (len(nodes), next(iter(nodes), None), next(reversed(nodes), None))
    known = _FOUND.get(graph)
    if known is not None and known[0] == shape:
        return known[1]
    loops = _find(graph)
    _FOUND[graph] = (shape, loops)
    return loops


def _find(graph: fx.Graph) -> dict:
    order = {node: index for index, node in enumerate(graph.nodes)}
    candidates = {}  # (value, dim) -> {head: select}
    values = {node.args[0] for node in graph.nodes if node.op == "call_function" and node.target is aten.select.int}
    for value in values:
        if isinstance(value, fx.Node):
            for dim, selects in _head_selects(value).items():
                candidates[(value, dim)] = selects
    loops, seen = {}, set()
    for (value, dim), selects in sorted(candidates.items(), key=lambda item: min(map(order.get, item[1].values()))):
        if selects[0] in seen:
            continue
        loop = _grow(selects, candidates, order)
        if loop is None:
            seen.update(selects.values())
            continue
        seen.update(node for chain in loop.chains for node in chain)
        loops[loop.first] = loop
    return loops


def _head_selects(value) -> dict:
    """{dim: {index: select}} of ``value``'s selects that take every index of a dim of 2 or more, each once."""
    val = _val(value)
    if not isinstance(val, torch.Tensor):
        return {}
    by_dim: dict = {}
    for user in value.users:
        if user.op != "call_function" or user.target is not aten.select.int or user.args[0] is not value:
            continue
        dim, index = _arg(user, 1, "dim"), _arg(user, 2, "index")
        if not isinstance(dim, int) or not isinstance(index, int):
            continue
        dim %= val.dim()
        size = val.shape[dim]
        if not isinstance(size, int):
            continue
        by_dim.setdefault(dim, []).append((index % size, user))
    found = {}
    for dim, pairs in by_dim.items():
        size = val.shape[dim]
        if size >= 2 and sorted(i for i, _user in pairs) == list(range(size)):
            found[dim] = dict(pairs)
    return found


def _grow(start: dict, candidates: dict, order: dict):
    """The loop whose chains begin at the selects ``start`` ({head: select}), or None where what they reach is not a
    loop over heads (two heads' values meet outside a join, a result leaves the loop unjoined, the chains differ)."""
    heads = len(start)
    label: dict = {}  # node -> its head
    selects: dict = {}  # (value, head) -> select
    joins: set = set()
    todo = collections.deque((node, head) for head, node in start.items())  # breadth first: two heads meet soon
    begins = min(order[node] for node in start.values())  # the loop's first select (``find`` starts there)
    select_of = {sel: (value, dim, head) for (value, dim), group in candidates.items()
                 if len(group) == heads and order[value] < begins  # (not a loop inside a head's ops: over time)
                 for head, sel in group.items()}
    while todo:
        while todo:
            node, head = todo.popleft()
            if node in label:
                if label[node] != head:
                    return None
                continue
            label[node] = head
            if node in select_of:
                value, _dim, _head = select_of[node]
                selects[(value, head)] = node
            for user in node.users:
                if user.op != "call_function":
                    return None  # a head's value leaves the stage
                if user.target in _JOINS:
                    joins.add(user)
                    continue
                todo.append((user, head))
            if node not in select_of:
                for above in _selects_above(node, select_of, label, order, begins):
                    todo.append((above, select_of[above][2]))
            for arg in node.all_input_nodes:  # a value made from nothing for this head alone (a scan's zeros)
                if arg not in label and arg.op == "call_function" and not arg.all_input_nodes and len(arg.users) == 1:
                    todo.append((arg, head))
        for join in list(joins):  # a join of one head's values is an op of its chain
            pieces = join.args[0] if isinstance(join.args[0], (list, tuple)) else ()
            inside = {label.get(piece) for piece in pieces if isinstance(piece, fx.Node)}
            if len(inside) == 1 and None not in inside:
                joins.discard(join)
                todo.append((join, next(iter(inside))))
    chains = [sorted((n for n, h in label.items() if h == head), key=order.get) for head in range(heads)]
    if not all(chains) or len({len(chain) for chain in chains}) != 1:
        return None
    taken = {}
    for (value, head), node in selects.items():
        taken[value] = select_of[node][1]
    if any((value, head) not in selects for value in taken for head in range(heads)):
        return None  # a value some heads take one by one and others read otherwise
    join_dims = {}
    for join in joins:
        pieces = join.args[0]
        if (not isinstance(pieces, (list, tuple)) or len(pieces) != heads
                or any(label.get(piece) != head for head, piece in enumerate(pieces))):
            return None
        out = _val(join)
        dim = _arg(join, 1, "dim")
        dim = (0 if dim is None else dim) % out.dim()
        if join.target is aten.cat.default and not all(_equal(_val(p).shape[dim], _val(pieces[0]).shape[dim])
                                                       for p in pieces):
            return None  # (sizes compared as expressions: a dim of the batch is symbolic under --dynamic)
        join_dims[join] = dim
    if not join_dims or not _same_chains(chains, label, selects):
        return None
    first = min((node for chain in chains for node in chain), key=order.get)
    if any(order[value] > order[first] for value in taken):
        return None  # a value taken by heads made inside the loop
    return Loop(heads, taken, chains, selects, join_dims, first)


def _selects_above(node, select_of: dict, label: dict, order: dict, begins: int) -> list:
    """Heads' selects among the ops above ``node`` made since the loop begins (``B[h].transpose(1, 2)``, a time
    step's ``softplus(dt[h] + bias[h])``), not through a value already in a chain."""
    found, todo, seen = [], list(node.all_input_nodes), set()
    while todo:
        arg = todo.pop()
        if arg in seen or arg in label or order[arg] < begins:
            continue
        seen.add(arg)
        if arg in select_of:
            found.append(arg)
        elif arg.op == "call_function":
            todo += arg.all_input_nodes
    return found


def _same_chains(chains: list, label: dict, selects: dict) -> bool:
    """Every chain the same ops as the first, reading the same values outside the loop, its own head of each value
    taken, and writing nothing in place."""
    position = {node: index for chain in chains for index, node in enumerate(chain)}
    heads_select = {node: (value, head) for (value, head), node in selects.items()}
    first = chains[0]
    for head, chain in enumerate(chains):
        for mine, theirs in zip(chain, first):
            if mine.op != "call_function" or mine.target is not theirs.target:
                return False
            schema = getattr(mine.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                return False
            if mine in heads_select:
                if heads_select[mine][0] is not heads_select.get(theirs, (None,))[0]:
                    return False
                continue
            if not _same_args((mine.args, mine.kwargs), (theirs.args, theirs.kwargs), label, position, head):
                return False
    return True


def _same_args(mine, theirs, label: dict, position: dict, head: int) -> bool:
    if isinstance(mine, fx.Node) or isinstance(theirs, fx.Node):
        if not (isinstance(mine, fx.Node) and isinstance(theirs, fx.Node)):
            return False
        if mine in label or theirs in label:
            return label.get(mine) == head and label.get(theirs) == 0 and position[mine] == position[theirs]
        return mine is theirs or (not mine.all_input_nodes and not theirs.all_input_nodes and mine.op == theirs.op
                                  and mine.target is theirs.target and mine.args == theirs.args
                                  and mine.kwargs == theirs.kwargs)  # made from nothing alike (zeros of a shape)
    if isinstance(mine, (list, tuple)):
        return (isinstance(theirs, (list, tuple)) and len(mine) == len(theirs)
                and all(_same_args(a, b, label, position, head) for a, b in zip(mine, theirs)))
    if isinstance(mine, dict):
        return (isinstance(theirs, dict) and mine.keys() == theirs.keys()
                and all(_same_args(mine[k], theirs[k], label, position, head) for k in mine))
    return type(mine) is type(theirs) and mine == theirs
