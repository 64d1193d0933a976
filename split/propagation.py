"""One propagation for every parallel plan: a stage graph walked once in order, each value's placement on one mesh
dimension decided by the op that makes it, from the placements of its inputs.

The tensor-parallel walk (``tp_walk._Walk``: heads, features and, under sequence parallelism, tokens), the
context-parallel walk (``cp_walk._Walk``: positions) and expert parallelism's (``ep_walk._Walk``: the (token,
expert) rows of a block of routed experts, from its first grouped matmul to its last) are subclasses. They share the node loop and every rule whose
answer does not depend on what the sharded dim means: an op that moves dims (:meth:`_move`), one that works along
one dim (:meth:`_along`: softmax, scans, sorts, flips, windows), one that reads trailing dims (:meth:`_trailing`:
pads, triangles), a norm over the trailing dims (:meth:`_on_norm`), an expand (:meth:`_on_expand`) and a reduction
(:meth:`_reduce`), each asking ``split.rules`` where the shard goes. What
differs per mesh dimension is what a planner does where a rule says "this op reads across the sharded dim"
(:meth:`_across`: tensor parallelism gathers the value, context parallelism refuses naming the op) and with a
reduction's partial result (:meth:`_partial`: tp and cp both combine a sum or a mean with an all-reduce). Those, the
seeds (which values begin sharded) and the rules for contractions, attention, views, cuts and elementwise operands
(whose whole operands are cut, copied or gathered by each planner's costs) stay in the planners.

Every op is placed by the rule of its family (``rules.family``: elementwise, view, move, reduction, contraction,
attention, cut, join, index, along, convolution, collective, ...), found by name: :meth:`_rule` calls the planner's
``_on_<family>``; the families whose rule is shared are defined here, and a planner that has no method for a family
has no rule for it (tensor parallelism then asks torch's DTensor rule, context parallelism refuses).

A subclass provides ``shard`` (node -> its placement), :meth:`_dim` (the sharded dim of a placed value),
:meth:`_carry` (place a node as another value is placed, on a given dim), ``items`` (a multi-output node's
placements), :meth:`_across`, :meth:`_partial` and ``_local_size(sizes, dim, size)`` (a view's or expand's size list
can be rewritten to a rank's size at ``dim``; tensor parallelism's is a mixin's, so it is not stubbed here).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tracepp.split import rules


class Propagation:
    """The node loop and the rules shared by every mesh dimension's walk."""

    WORK = {"visits": 0}  # nodes visited (tests count a plan's work, not its time); each planner has its own
    shard: dict
    items: dict

    def _walk(self, graph: fx.Graph) -> None:
        for node in graph.nodes:
            self.WORK["visits"] += 1
            self._visit(node)

    # -- what a planner provides
    def _visit(self, node) -> None:
        raise NotImplementedError

    def _dim(self, node) -> int:
        """The sharded dim of a placed value."""
        raise NotImplementedError

    def _ranks(self) -> int:
        """How many pieces a sharded dim is cut into."""
        raise NotImplementedError

    def _entry(self, node, dim=None):
        """A placed value's placement as a multi-output op's ``items`` hold it (moved to ``dim`` where given)."""
        raise NotImplementedError

    def _carry(self, node, source, dim=None) -> None:
        """``node`` placed as ``source`` is (on ``dim`` where the op moved it)."""
        raise NotImplementedError

    def _across(self, node, what: str) -> bool:
        """``node`` reads across the sharded dim of its input (``what`` says how): False where the planner makes
        the input whole, True where it refused (the refusal recorded)."""
        raise NotImplementedError

    def _partial(self, node, kind: str, dims: list) -> bool:
        """A reduction over the sharded dim leaves each rank a partial ``kind`` (``rules.partial_kind``)."""
        raise NotImplementedError

    def _normalisable(self, x) -> bool:
        """A norm may read ``x`` as it is placed (tp: not a fused projection's parts)."""
        return True

    def _normalised_across(self, node) -> bool:
        """A norm over the sharded dim: made whole, written out or refused (as :meth:`_across`)."""
        raise NotImplementedError

    def _read_beside(self, node, args: list) -> None:
        """Whole operands (a norm's weight and bias) read beside a shard as they are."""

    def _operands(self, node) -> list:
        """The tensor operands of an elementwise op."""
        return node.all_input_nodes

    def _beside(self, node, entry, whole: list) -> bool:
        """An elementwise op's whole operands beside its shards, ``(operand, its dim lined up with the shard)`` (None:
        broadcast along it): what each becomes (cut to the rank's piece, read as it is, sharded with the value,
        refused). False or a refusal where one cannot be placed."""
        raise NotImplementedError

    def _place_entry(self, node, entry, sources: list) -> None:
        """``node`` placed at ``entry`` (``_entry``'s form), made from the sharded ``sources``."""
        raise NotImplementedError

    # -- the rule of an op, found by what it computes
    def _rule(self, node, sharded: list) -> bool:
        """Place ``node`` (reading the placed ``sharded``) by its family's rule: the planner's ``_on_<family>``
        (``rules.family``: one key per op, registered once), False where the planner has none (its fallback, or a
        refusal). The families whose answer does not depend on what the sharded dim means are defined here."""
        handler = getattr(self, "_on_" + rules.family(node.target), None)
        return handler is not None and handler(node, sharded)

    def _on_elementwise(self, node, sharded) -> bool:
        return self._elementwise(node)

    def _on_move(self, node, sharded) -> bool:
        return sharded == [node.args[0]] and self._move(node)

    def _on_along(self, node, sharded) -> bool:
        return self._along(node)

    def _on_trailing(self, node, sharded) -> bool:
        return sharded == [node.args[0]] and self._trailing(node)

    def _on_reduction(self, node, sharded) -> bool:
        return sharded == [node.args[0]] and self._reduce(node)

    def _on_norm(self, node, sharded) -> bool:
        """layer_norm / rms_norm over the trailing dims (``rules.last_dims``): a shard of another dim (the sequence,
        heads) is normalised as it is, each output (``native_layer_norm``'s mean and rstd too) placed as the input;
        its weight and bias are read whole beside it (:meth:`_read_beside`). Over the sharded dim the planner says
        what happens (:meth:`_normalised_across`: tp gathers or writes the norm out, cp refuses)."""
        x = node.args[0]
        if sharded != [x] or not self._normalisable(x):
            return False
        if self._dim(x) >= rules.val(x).dim() - rules.last_dims(node):
            return self._normalised_across(node)
        self._read_beside(node, [arg for arg in node.args[2:4] if isinstance(arg, fx.Node)])
        if node.target is torch.ops.aten.native_layer_norm.default:
            self.items[node] = [self._entry(x)] * 3
        self._carry(node, x)
        return True

    def _on_expand(self, node, sharded) -> bool:
        """``expand`` / ``broadcast_to``: new dims come in front, so the shard moves right by their count
        (``rules.expanded_dim``); the size argument there must be one the planner's rewrite makes a rank's
        (:meth:`_local_size`)."""
        first = node.args[0]
        if sharded != [first]:
            return False
        dim = rules.expanded_dim(node, self._dim(first))
        if not self._local_size(node.args[1], dim, rules.sizes(rules.val(node))[dim]):
            return False
        self._carry(node, first, dim)
        return True

    def _on_expand_as(self, node, sharded) -> bool:
        """``x.expand_as(other)``: ``x`` broadcast to ``other``'s shape, an elementwise op whose second operand
        gives only its shape. Placed as ``other`` where ``x`` is placed alike (lined up from the right), or whole and
        broadcast along the sharded dim (F.normalize's norm, ``[b, s, 1]`` expanded to the features: each position's
        row, each rank's features); what a whole ``x`` becomes, the planner says (:meth:`_beside`)."""
        first, other = node.args[0], node.args[1]
        if not isinstance(other, fx.Node) or other not in self.shard:
            return False
        n, entry = rules.val(node).dim(), self._entry(other)
        whole = []
        if first in self.shard:
            if self._entry(first, self._dim(first) + n - rules.val(first).dim()) != entry:
                return False
        elif rules.aligned_dim(n, entry[0], rules.val(first)) is not None:
            return False  # as wide as the sharded dim: its local shape is not the piece's
        else:
            whole.append((first, None))
        if not self._beside(node, entry, whole):
            return False
        self._place_entry(node, entry, [a for a in (first, other) if a in self.shard])
        return True

    # -- the rules every dimension shares (the sharded input is ``node.args[0]``)
    def _place_out(self, node, source, dim) -> None:
        """``node``'s output (or each of its outputs: values and indices) placed as ``source`` on ``dim``."""
        out = rules.val(node)
        if isinstance(out, (list, tuple)):
            self.items[node] = [self._entry(source, dim)] * len(out)
        else:
            self._carry(node, source, dim)

    def _elementwise(self, node) -> bool:
        """An elementwise op broadcasting its operands: the sharded ones must line up on one output dim, placed
        alike (the same segments, the same sequences); every whole operand is lined up with that dim
        (``rules.aligned_dim``) and must be as wide there as the output or broadcast along it, and the planner
        says what it becomes (:meth:`_beside`)."""
        out_val = rules.val(node)
        if not isinstance(out_val, torch.Tensor):
            return False
        n = out_val.dim()
        entry, sources = None, []
        for arg in self._operands(node):
            if arg in self.shard:
                here = self._entry(arg, self._dim(arg) + n - rules.val(arg).dim())
                if entry is not None and here != entry:
                    return False
                entry = here
                sources.append(arg)
        if entry is None:
            return False
        whole = self._lined_up(node, entry[0])
        if whole is None or not self._beside(node, entry, whole):
            return False
        self._place_entry(node, entry, sources)
        return True

    def _lined_up(self, node, dim: int):
        """``[(operand, its dim lined up with the output's dim)]`` for each whole tensor operand of an elementwise
        op (``rules.aligned_dim``: None where it broadcasts along it), or None where one is there but not as wide as
        the output."""
        out_val, whole = rules.val(node), []
        for arg in self._operands(node):
            val = rules.val(arg)
            if arg in self.shard or not isinstance(val, torch.Tensor):
                continue
            at = rules.aligned_dim(out_val.dim(), dim, val)
            if at is not None and not rules.equal(val.shape[at], out_val.shape[dim]):
                return None
            whole.append((arg, at))
        return whole

    def _move(self, node) -> bool:
        """transpose, permute, movedim, unsqueeze, squeeze, complex views: the shard follows its dim."""
        first = node.args[0]
        dim = rules.moved_dim(node, self._dim(first), self._ranks())
        if dim is None:
            return self._across(node, "regrouping the sharded dim")
        self._carry(node, first, dim)
        return True

    def _along(self, node) -> bool:
        """An op along one dim (softmax, a scan, a sort, top-k, flip, unfold, a gather or scatter at an index):
        carried where that dim is not the sharded one; an index (and a scattered source) must be placed as the
        input is."""
        first = node.args[0]
        if first not in self.shard:
            return False
        dim = self._dim(first)
        if dim in rules.along_dims(node):
            return self._across(node, "along the sharded dim")
        if node.target in rules.INDEXED_ALONG:
            for other in node.args[2:4]:
                if isinstance(other, fx.Node) and rules.val(other).dim() and (
                        other not in self.shard or self._entry(other) != self._entry(first)):
                    return False
        self._place_out(node, first, dim)
        return True

    def _trailing(self, node) -> bool:
        """An op over the trailing dims (a pad's, a triangle's matrix): carried where the shard is before them."""
        first = node.args[0]
        if self._dim(first) >= rules.val(first).dim() - rules.last_dims(node) and (
                node.target not in rules.PADS or rules.pads_dim(node, self._dim(first))):
            return self._across(node, "over the sharded dim (one of its trailing dims)")
        self._carry(node, first)
        return True

    def _reduce(self, node) -> bool:
        """A reduction: over other dims the shard is carried (moved where the reduced dims are dropped); over the
        sharded dim each rank holds a partial result of the reduction's kind (:meth:`_partial`)."""
        first = node.args[0]
        dim = rules.reduced_dim(node, self._dim(first))
        if dim is None:
            return self._partial(node, rules.partial_kind(node), rules.reduction(node)[0])
        self._place_out(node, first, dim)
        return True
