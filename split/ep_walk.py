"""Expert parallelism's walk: the (token, expert) rows of a block of routed experts placed through the block by the
one propagation (``split.propagation``), as tensor and context parallelism place their dims.

A block's rows (``expert_parallel.find_blocks``: what its grouped matmuls read, sorted by expert) are sharded on
dim 0 over the ep ranks by expert: each rank computes the rows of its own experts. The walk starts there and places
every value from the rows to the block's last grouped matmul by the rules every mesh dimension shares
(``split.rules``): an elementwise op carries the rows (torch's pointwise tag or a family: Nemotron-H's squared ReLU),
a cut, a move, a reduction or an op along one dim carries them where it leaves dim 0 alone (GPT-OSS's interleaved
gate and up, ``[..., ::2]``), and anything that reads across the rows (a cut of them, a reduction over them, a view
whose size list holds their count, an op no rule places) is refused by name with the model's line. What is
expert parallelism's own is what a whole operand beside the rows becomes (:meth:`_Walk._beside`): broadcast along
them it is read on the expert's rank as it is; one row per (token, expert) pair it must be a per-expert parameter
gathered by the sorted expert ids (GPT-OSS's expert biases, gathered again on the expert's rank), or the mask of
rows routed to no expert (never dispatched: the fill is dropped). A value placed inside the block and read
outside it is refused: the rows it holds are on another rank.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.cost import op_name
from tracepp.split.propagation import Propagation

aten = torch.ops.aten
WORK = {"visits": 0}
_MOVES_ROWS = "moves the rows off dim 0"


def ancestors(node, since=None) -> set:
    """Every node ``node`` is computed from; with ``since``, only those from ``since`` on in graph order (a block's
    nodes from its rows: a path between two nodes runs through nodes between them, so the search stops at
    ``since`` instead of walking the whole graph before it, once per block)."""
    bound = getattr(since, "_sort_key", None)
    seen, stack = set(), [node]
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in seen and (bound is None or arg._sort_key >= bound):
                seen.add(arg)
                stack.append(arg)
    return seen


def span(first, last):
    """The nodes of a graph from ``first`` to ``last``, in order."""
    node = first
    while True:
        yield node
        if node is last:
            return
        node = node.next


def checks_dtype_only(node) -> bool:
    """``aten._assert_tensor_metadata`` of a dtype, device or layout (what ``x.to(dtype)`` leaves in the graph),
    true of this rank's experts as of all of them; not one of a size or strides."""
    if node.target is not aten._assert_tensor_metadata.default:
        return False
    sizes = list(node.args[1:3]) + [node.kwargs.get("size"), node.kwargs.get("stride")]
    return all(size is None for size in sizes)


def sentinel(mask, num_experts: int) -> bool:
    """A mask of the rows routed to no expert (``expert_ids >= num_experts``, as transformers marks the
    sentinels of its own expert parallelism), through views and unsqueezes."""
    while isinstance(mask, fx.Node) and op_name(mask) in (
            "aten::unsqueeze", "aten::view", "aten::reshape", "aten::expand", "aten::_to_copy", "aten::to"):
        mask = mask.args[0]
    if not isinstance(mask, fx.Node) or len(mask.args) < 2 or not isinstance(mask.args[1], (int, float)):
        return False
    bound = mask.args[1]
    return ((op_name(mask) == "aten::ge" and bound == num_experts)
            or (op_name(mask) == "aten::gt" and bound == num_experts - 1))


def expert_bias(node, block):
    """(fqn, placeholder) when ``node`` is ``param[expert_ids]``: a parameter of one row per expert gathered by the
    expert id of each sorted row (the sort's values, whose order the rows follow), else None."""
    if node.target is not aten.index.Tensor or len(node.args[1]) != 1:
        return None
    param, (ids,) = node.args[0], node.args[1]
    fqn_of = block.fqn_of or {}
    if not (isinstance(param, fx.Node) and param.op == "placeholder" and param.name in fqn_of
            and int(rules.val(param).shape[0]) == block.num_experts):
        return None
    while isinstance(ids, fx.Node) and op_name(ids) in ("aten::_to_copy", "aten::to", "aten::clamp",
                                                              "aten::clamp_"):
        ids = ids.args[0]
    if not (isinstance(ids, fx.Node) and ids.target is operator.getitem and ids.args[1] == 0
            and op_name(ids.args[0]) == "aten::sort"):
        return None
    order = [u for u in ids.args[0].users if u.target is operator.getitem and u.args[1] == 1]
    if not order or not any(o in ancestors(block.rows, since=o) for o in order):
        return None  # the rows do not follow this sort
    return fqn_of[param.name], param


class _Walk(Propagation):
    """The rows of one block placed from its first grouped matmul's input to its last one. ``shard``: node -> the
    dim its rows are on (0, or the refusal says where they went); ``refused``: why ``--ep`` cannot move the block,
    or ''. Records on the block what the rewrite needs: the sentinel fills it drops, the expert biases it gathers
    again."""

    WORK = WORK

    def __init__(self, block, ep: int = 2):
        self.block, self.ep = block, ep
        self.shard: dict = {block.rows: 0}
        self.items: dict = {}
        self.refused = ""
        last = block.out
        self.inside = ancestors(last, since=block.rows) | {last}  # what the block's output is computed from
        for node in span(block.rows.next, last):
            if node in self.inside and not self.refused:
                self.WORK["visits"] += 1
                self._visit(node)
        if not self.refused:
            self._read_outside()

    # -- what a placement is for ep: the dim of the rows (one block, one entry)
    def _dim(self, node) -> int:
        return self.shard[node]

    def _ranks(self) -> int:
        return self.ep

    def _entry(self, node, dim=None):
        return (self.shard[node] if dim is None else dim,)

    def _carry(self, node, source, dim=None) -> None:
        self.shard[node] = self.shard[source] if dim is None else dim

    def _place_entry(self, node, entry, sources: list) -> None:
        self.shard[node] = entry[0]

    def _local_size(self, sizes, dim: int, size) -> bool:
        return False  # sizes between the expert matmuls are not rewritten: no expand of the rows

    def _refuse(self, node, why: str) -> bool:
        self.refused = self.refused or f"{node.name} ({op_name(node)}){rules.at(node)} {why}"
        return True

    def _across(self, node, what: str) -> bool:
        return self._refuse(node, f"reads across the rows between the expert matmuls ({what.replace('sharded dim', 'rows')}): "
                                  f"each ep rank holds the rows of its own experts")

    def _partial(self, node, kind: str, dims: list) -> bool:
        return self._refuse(node, f"reduces over the rows between the expert matmuls (a partial {kind} on each ep "
                                  f"rank): each ep rank holds the rows of its own experts")

    def _beside(self, node, entry, whole: list) -> bool:
        """A whole operand broadcast along the rows is read on the expert's rank as it is; one with a row per
        (token, expert) pair must be the sentinel mask or a per-expert parameter gathered by the sorted ids."""
        block = self.block
        for arg, at in whole:
            if at != entry[0]:
                continue
            if op_name(node) == "aten::masked_fill" and arg is node.args[1] and sentinel(arg, block.num_experts):
                block.sentinel_fills.append(node)  # rows past the last offset: never dispatched, so a no-op there
                continue
            bias = expert_bias(arg, block) if rules.val(arg).dim() >= 2 else None
            if bias is None:
                return self._refuse(node, f"reads {arg.name}, one row per (token, expert) pair made outside the "
                                          f"expert matmuls, which is not a per-expert parameter gathered by the "
                                          f"sorted expert ids")
            block.biases[bias[0]] = bias[1]
            if arg not in block.gathers:
                block.gathers.append(arg)
        return True

    # -- the walk
    def _visit(self, node) -> None:
        if node.op != "call_function" or node.target in rules.IGNORED or checks_dtype_only(node):
            return
        sharded = [a for a in node.all_input_nodes if a in self.shard]
        if node.target is operator.getitem and node.args[0] in self.items:
            entry = self.items[node.args[0]][node.args[1]]
            if entry is not None:
                self.shard[node] = entry[0]
            return
        if not sharded:
            return
        if node in self.block.matmuls:
            if node.args[0] not in self.shard:
                self._refuse(node, "multiplies values other than the block's rows by the experts")
            else:
                self._carry(node, node.args[0], 0)
            return
        if not self._rule(node, sharded):
            self._refuse(node, "runs between the expert matmuls and is not a per-row op")
        elif node in self.shard and self.shard[node] != 0:
            self._refuse(node, _MOVES_ROWS)
        elif node in self.items and any(e is not None and e[0] != 0 for e in self.items[node]):
            self._refuse(node, _MOVES_ROWS)

    # -- each family's rule (``Propagation._rule``; the rows stay on dim 0: elementwise ops, moves, reductions and
    # ops along a dim are the shared rules)
    def _on_cut(self, node, sharded) -> bool:
        first = node.args[0]
        if first not in self.shard:
            return False
        if rules.cut_dim(node) == self._dim(first):
            return self._refuse(node, "cuts the rows between the expert matmuls")
        self._place_out(node, first, self._dim(first))  # a cut after dim 0 leaves the rows on dim 0
        return True

    _on_norm = None  # no norm between the expert matmuls (refused by name, as before)

    def _on_cast(self, node, sharded) -> bool:
        if node.args[0] not in self.shard:
            return rules.is_pointwise(node.target) and self._elementwise(node)
        self._carry(node, node.args[0])
        return True

    _on_dtype_of = _on_cast

    def _on_write(self, node, sharded) -> bool:
        return self._elementwise(node)

    def _read_outside(self) -> None:
        """A value placed inside the block (not the rows, not the block's output) read outside it: refused."""
        for node in list(self.shard) + list(self.items):
            if node is self.block.rows or node is self.block.out:
                continue
            for user in node.users:
                if user not in self.inside and not checks_dtype_only(user):
                    self.refused = (f"{node.name} ({op_name(node)}){rules.at(node)} runs on the rows between "
                                    f"the expert matmuls and is also read by {user.name} ({op_name(user)})"
                                    f"{rules.at(user)} outside them")
                    return
