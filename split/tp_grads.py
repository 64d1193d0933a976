"""Where the gradients of whole values read by sharded ops are summed over tp: placed by cost, as the forward's
partial sums are (``tp_partial``), and for parameters not before the step ends.

A whole value read beside shards (a column-wise linear's input, a per-head norm's weight, a mask) takes on each
tp rank a part of its gradient: ``tp_copy``'s backward all-reduces it there. The sum can wait. Autograd is linear
in the gradient it is given, and an op every rank computes whole from whole values computes the same backward on
each rank, so each rank's part passes through it as a part of its inputs' gradients (DTensor's ``Partial(sum)``,
carried backward). Carried up, the parts are summed at one value where they meet (Llama 4's MoE: its experts read
every token ``experts`` times, a ``repeat`` of the layer's input scaled by the router's scores, beside the shared
expert reading the input itself: one all-reduce of ``[tokens, h]`` where there were ``[experts, tokens, h]`` and
``[tokens, h]``), or reach a parameter, whose parts accumulate over the step's microbatches and are summed once
when the step ends (``runtime.tensor_parallel.StepSums``, all such gradients in one all-reduce; Megatron-Core's
``finalize_model_grads`` does so for its q/k layernorms and sequence-parallel norms).

:func:`mark` chooses, per stage, which values carry partial gradients, by a minimum cut over the values a copy's
part can reach: a value may hold a part only where every gradient it takes is a part (every reader holds one or
reads it through a copy) and it is computed whole from whole values by ops the plan leaves alone; each value that
takes parts and gives a whole gradient to its inputs costs its bytes (its ``tp_copy``); a parameter holding parts
costs nothing per microbatch. Ties go to fewer values carried (the copies where the walk put them). A parameter's
gradient is summed at one time: partial in every stage that reads it, or in none. The copies the walk asked for
at the values this places are dropped; each value it sums gets one ``tp_copy``, read by every reader that gives
it a part (``tp_rewrite``)."""
from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.cost import tensor_bytes
from tracepp.split.rules import val as _val

_SCALE = 1 << 20  # a byte of a collective outweighs every tie-break together (one unit per value carried)


def _bias_reads(walk) -> set:
    """(row-wise linear, bias) pairs the rewrite reads through a ``tp_copy`` of its own: the biases of the deferred
    (``tp_partial``) and reduce-scattered row-wise linears, where they carry a gradient."""
    pairs = set()
    for node, role in walk.roles.items():
        bias = walk.forms[node][2] if role == "rowwise" else None
        if isinstance(bias, fx.Node) and walk.needs_grad.get(bias) and (
                node in walk.deferred or node in walk.reduce_scatters):
            pairs.add((node, bias))
    return pairs


def _copied_reads(walk) -> set:
    """(consumer, value) pairs the rewrite reads through ``tp_copy``: the walk's copies and :func:`_bias_reads`."""
    return set(walk.copies) | _bias_reads(walk)


def _piece_reads(walk) -> set:
    """(consumer, value) pairs of a whole value read at this rank's piece of a dim (``tp_scatter``), where the
    value carries a gradient: each rank's gradient is its piece, zeros elsewhere, a part of the whole one. Summed
    right there, the pieces are all-gathered (half an all-reduce's bytes); carried back, the read is ``tp_piece``
    and a ``tp_copy`` sums the parts where they meet. Unequal segments (``tp_parts``) are not."""
    return {(consumer, arg) for consumer, arg, _dim, groups in walk.scatters
            if isinstance(groups, int) and _whole(walk, arg)}


def _whole(walk, node) -> bool:
    """A tensor every rank computes whole and that carries a gradient, or the tuple of a split's pieces of one
    (ProphetNet's ``hidden_states.chunk(1 + ngram, dim=1)``: the parts of its items' gradients pass to the tensor
    it cut); not another op's tuple (``topk``'s items are values of their own)."""
    if not (isinstance(node, fx.Node) and node.op != "output" and node not in walk.shard
            and walk.needs_grad.get(node)):
        return False
    return isinstance(_val(node), torch.Tensor) or (node.target in rules.CUTS and isinstance(_val(node), (tuple, list)))


def _made_by_the_plan(walk, node) -> bool:
    """A whole value the plan computes otherwise than as the model does (a collective's result, partial sums,
    a piece its owner alone computes) or a value read in from outside the stage: its gradient must be whole."""
    if node.op == "placeholder":
        return node.name not in walk.fqn_of
    return (node in walk.roles or node in walk.sums or node in walk.late_sums or node in walk.partial
            or node in walk.mixed_linears or node in walk.owned or node in walk.owned_splits
            or node in walk.loop_live or (walk.needs_grad.get(node) and _written_then_read(node))
            or any(walk.needs_grad.get(a) and not _whole(walk, a) for a in node.all_input_nodes))


def _made_fresh(node) -> bool:
    """A tensor made fresh or like another (``new_full``, ``zeros_like``): it takes no gradient from its inputs."""
    return node.op == "call_function" and (node.target in rules.LIKE or node.target in rules.FRESH)


def _written_then_read(node) -> bool:
    """A tensor made fresh (or like another) that values carrying a gradient are written into in place and that is
    read as a value (DeepSeek-V4's compressor: slices of a ``new_full`` filled, then its softmax taken): its gradient
    flows to what was written into it, which this pass does not follow, so it must be whole. One only written into
    and read through the write's result (Llama 4's ``full_like(...).scatter_(...)``) passes nothing on: not so."""
    if not _made_fresh(node):
        return False
    todo, seen = [node], set()
    while todo:
        value = todo.pop()
        for user in value.users:
            if user in seen:
                continue
            seen.add(user)
            if value in rules.written(user):
                continue  # the write itself
            if rules.is_view(user):
                todo.append(user)  # a view of it: written through, or read
            else:
                return True
    return False


def dead(walk) -> set:
    """Values that carry a gradient (``needs_grad``) none of which reaches the stage's outputs: every way from them
    ends in a ``detach`` or in nothing (a straight-through estimator's ``x + (q(x) - x).detach()``: the scale of
    ``q`` read from ``x``). A reader of such a value gives it no part of the gradient. An op that writes into a
    tensor in place passes its gradient on where the tensor written (or the one it is a view of) is read after it
    by a value whose gradient does, or is a buffer or an input."""
    live: set = set()
    for node in reversed(list(walk.graph.nodes)):
        if node.op == "output":
            live.update(node.all_input_nodes)
        elif node in live or (node.op == "call_function" and _write_read_on(node, live)):
            live.add(node)
            if node.target is not torch.ops.aten.detach.default:
                live.update(node.all_input_nodes)
    return {node for node in walk.graph.nodes if walk.needs_grad.get(node) and node not in live}


def _write_read_on(node, live: set) -> bool:
    for arg in rules.written(node):
        if not isinstance(arg, fx.Node):
            continue
        root = rules.view_root(arg)
        if root.op == "placeholder" or any(user is not node and user in live for user in (*root.users, *arg.users)):
            return True
    return False


def _solve(walk, pinned: set) -> tuple:
    """(the values holding partial gradients, {value summed: its readers that give it a part}) of one walk;
    ``pinned``: FQNs of parameters that must be summed per microbatch (another stage reads them otherwise)."""
    pieces = _piece_reads(walk)
    copied = _copied_reads(walk) | pieces  # the reads that give a value a part of its gradient
    readers_copied: dict = {}
    dead_values = dead(walk)
    for consumer, value in copied:
        if _whole(walk, value) and value not in dead_values:
            readers_copied.setdefault(value, []).append(consumer)
    reach, stack = set(), list(readers_copied)  # the values a copy's part can reach, going up
    while stack:
        node = stack.pop()
        if node in reach:
            continue
        reach.add(node)
        if _made_fresh(node):
            continue  # a tensor made like another takes no gradient from it (written in place after: its own)
        stack += [a for a in node.all_input_nodes if _whole(walk, a) and a not in reach]
    order = {node: index for index, node in enumerate(walk.graph.nodes)}
    may: dict = {}  # value -> may hold a part (every gradient it takes is one)
    for node in sorted(reach, key=order.get, reverse=True):
        fixed = _made_by_the_plan(walk, node) or walk.fqn_of.get(node.name) in pinned
        ok = not fixed
        for user in node.users:
            if not ok:
                break
            if (user, node) in copied or user.target in rules.IGNORED or user in dead_values:  # a metadata check, or a
                continue                                                                 # reader given none back
            if user.op == "output" or walk.needs_grad.get(user) or user in walk.shard:
                ok = may.get(user, False)
        may[node] = ok
    reach = sorted(reach, key=order.get)  # graph order: the same answer, and the same listing, every run
    edges: list = []  # (from, to, capacity or None: unbounded), "part" the source and "whole" the sink
    for node in reach:
        here = node if may[node] else "whole"
        sums = ("sum", node)  # on the source side: a reader gives this value a part
        read = False
        for user in node.users:
            if (user, node) in copied:
                edges.append(("part", sums, None))
                read = True
            elif may.get(user, False):
                edges.append((user, sums, None))
                read = True
                if here != "whole":
                    edges.append((node, user, None))  # a value holding a part: so does each reader
        if read and not isinstance(_val(node), torch.Tensor):  # a split's pieces: summed in its items, or carried
            edges.append((sums, here, None))                    # through it whole (no tp_copy of a tuple)
        elif read:  # cut where the value gives whole gradients to its inputs: its all-reduce (an all-gather, half
            #        the bytes, where only reads at a piece can give it parts)
            gathered = all((user, node) in pieces for user in node.users
                           if (user, node) in copied or may.get(user, False))
            edges.append((sums, here, tensor_bytes(_val(node)) * (1 if gathered else 2) * _SCALE + 1))
        if here != "whole":
            edges.append((node, "whole", 1))  # the tie-break: fewer values carried
    parts = _cut(edges, order)
    holding = {node for node in reach if may[node] and node in parts}
    summed = {}
    for node in reach:
        if node in holding or ("sum", node) not in parts:
            continue
        readers = sorted((user for user in node.users if (user, node) in copied or user in holding), key=order.get)
        if all((user, node) in pieces for user in readers):
            continue  # only reads at a piece: their pieces all-gathered (tp_scatter), no sum placed
        summed[node] = readers
    return holding, summed


_CUTS: dict = {}  # a group's shape (its edges and capacities, in graph order) -> its source side, by position


def _cut(edges: list, order: dict) -> set:
    """The source side of a minimum cut of ``edges`` ("part" to "whole"), solved per group of values joined apart
    from the two ends: a group of sums alone (no value that may hold a part) is summed where it is, without a
    flow (most groups: a linear's input nothing above could carry); a group shaped as one solved before (the same
    op in every repeated layer) takes that answer."""
    ends = ("part", "whole")
    inner = dict.fromkeys(n for a, b, _capacity in edges for n in (a, b) if n not in ends)
    groups = rules.components(inner, ((a, b) for a, b, _capacity in edges if a not in ends and b not in ends))
    group_of = {n: k for k, group in enumerate(groups) for n in group}
    group_edges: list = [[] for _group in groups]
    for a, b, capacity in edges:
        group_edges[group_of[a if a not in ends else b]].append((a, b, capacity))
    parts = {"part"}
    for members, group in zip(groups, group_edges):
        members = sorted(members, key=lambda n: 2 * order[n[1]] + 1 if isinstance(n, tuple) else 2 * order[n])
        if all(isinstance(n, tuple) for n in members):  # sums only: each reached from "part" is on its side
            parts |= {b for a, b, _c in group if a == "part"}
            continue
        at = {n: k for k, n in enumerate(members)}
        at.update({"part": -1, "whole": -2})
        shape = tuple(sorted((at[a], at[b], -1 if c is None else c) for a, b, c in group))
        side = _CUTS.get(shape)
        if side is None:
            flow = nx.DiGraph()
            for a, b, capacity in group:
                flow.add_edge(a, b, **({} if capacity is None else {"capacity": capacity}))
            flow.add_nodes_from(ends)
            _value, (found, _rest) = nx.minimum_cut(flow, "part", "whole")
            side = _CUTS[shape] = frozenset(at[n] for n in found if n not in ends)
            if len(_CUTS) > 100_000:
                _CUTS.clear()
        parts |= {members[k] for k in side}
    return parts


def mark(walks: list) -> set:
    """Sets each walk's ``backward_sums`` ({value: its readers that read it through one ``tp_copy``}) and
    ``partial_holding`` (the values holding parts: parameters among them are summed when the step ends); returns
    the FQNs of those parameters."""
    pinned: set = set()
    while True:
        found = [(walk, *_solve(walk, pinned)) for walk in walks]
        partial = {walk.fqn_of[n.name] for walk, holding, _summed in found for n in holding
                   if n.op == "placeholder"}
        whole = {walk.fqn_of[n.name] for walk, holding, _summed in found for n in walk.graph.nodes
                 if n.op == "placeholder" and n.name in walk.fqn_of and _whole(walk, n) and n not in holding}
        mixed = partial & whole  # partial in one stage (or read), whole in another
        if not mixed:
            break
        pinned |= mixed
    for walk, holding, summed in found:
        bias = _bias_reads(walk)
        walk.backward_sums = {node: [u for u in users if (u, node) not in bias] for node, users in summed.items()}
        walk.partial_holding = holding
    return partial


def holding(walk) -> set:
    """The values holding partial gradients (:func:`mark`; none before it ran): a parameter among them is summed
    when the step ends, a row-wise linear's bias among them takes no copy."""
    return getattr(walk, "partial_holding", set())


def backward_sums(walk) -> dict:
    """{value: the readers, in graph order, that read it through one ``tp_copy``} of :func:`mark` (empty before
    it ran; a bias whose only reader is its row-wise linear, which copies it itself, has none)."""
    return getattr(walk, "backward_sums", {})


def partial_values(walk) -> set:
    """The whole values whose gradient's sum :func:`mark` placed: the walk's own copies of them are not inserted,
    and a read of one at a piece is ``tp_piece`` (its gradient a part), not ``tp_scatter``."""
    return holding(walk) | set(backward_sums(walk))


def piece_reads(walk) -> set:
    """(consumer, value) of the reads at a piece whose gradient is a part (``tp_piece``): :func:`_piece_reads` of
    the values :func:`partial_values` lists (the others' pieces are all-gathered, ``tp_scatter``)."""
    placed = partial_values(walk)
    return {(consumer, arg) for consumer, arg in _piece_reads(walk) if arg in placed}


def backward_reads(walk) -> list:
    """(reader, value) of every ``tp_copy`` whose backward all-reduces a gradient in each microbatch: the walk's
    copies of values that carry one and that :func:`mark` did not place, then each value it sums with its readers.
    The cost (``plan_cost``) and the tuner's figures (``tensor_parallel``) count these."""
    placed = partial_values(walk)
    dead_values = dead(walk)
    pairs = [(consumer, value) for consumer, value in walk.copies
             if walk.needs_grad.get(value) and value not in placed and value not in dead_values]
    return pairs + [(reader, value) for value, readers in backward_sums(walk).items() for reader in readers]
