"""Context parallelism's rules for ops that look back along the sequence (``cp_walk._Walk`` inherits them): a causal
convolution and a token shift, each chunk given the positions before it (``cp_halo``); a running sum or product,
each chunk's own combined with the totals of the chunks before it (``cp_cumsum``, ``cp_logcumsumexp``,
``cp_cumprod``); an outer op of two position shards, the later one's operand gathered as attention's keys are.
What each becomes in the rank's program: ``cp_rewrite``; the runtime ops: ``runtime/context_parallel.py``."""
from __future__ import annotations

import torch
import torch.fx as fx

import tracepp.runtime.context_parallel  # noqa: F401  (registers torch.ops.tracepp.cp_*)
from tracepp.split import rules
from tracepp.split.rules import equal as _equal, val as _val

aten = torch.ops.aten
CP = torch.ops.tracepp
SCANS = {aten.cumsum.default: CP.cp_cumsum.default,  # running values along the sequence: each chunk's own, plus
         aten.logcumsumexp.default: CP.cp_logcumsumexp.default,  # the chunks' before it
         aten.cumprod.default: CP.cp_cumprod.default}


class LookBack:
    """The rules of ops whose outputs read the positions before them along the sequence (a mixin of the cp walk:
    ``self.shard``, ``self.halos``, ``self.unhalos``, ``self.scans``, ``self.gathers`` are the walk's)."""

    def _causal(self, node) -> bool:
        """A causal 1-d convolution along the sequence: ``conv1d`` of stride 1 over the last dim, zero-padded by its
        reach ``dilation * (kernel - 1)`` on both sides, every use of it a cut back to the first ``seqlen`` outputs
        (LFM2's and Mamba's ``conv(x)[..., :seqlen]``, labml's and xLSTM's ``[..., :-(kernel - 1)]``): each output
        reads its own position and the ``reach`` before it. Its input is given each chunk's positions before it
        (``cp_halo``), the convolution runs unpadded, and the outputs between the two chunks are dropped
        (``cp_unhalo``)."""
        x = node.args[0]
        dim, groups = self.shard[x]
        reaches = rules.conv1d_reach(node)
        if reaches is None or groups != 1 or dim != _val(x).dim() - 1:
            return False
        padding, reach = reaches
        if reach <= 0 or padding != reach:
            return False
        length, ndim = self._global(x, dim), _val(x).dim()

        def cut_back(user) -> bool:
            if user.target is not aten.slice.Tensor or user.args[0] is not node or rules.cut_dim(user) != dim:
                return False
            end = rules.arg(user, 3, "end")
            end = _val(end) if isinstance(end, fx.Node) else end
            return (rules.arg(user, 2, "start") in (None, 0) and rules.arg(user, 4, "step", 1) == 1
                    and end is not None and (end == -reach or _equal(end, length)))

        users = list(node.users)
        if not users or not all(cut_back(user) for user in users) or ndim != 3:
            return False
        self.halos[node] = ("conv", dim, reach)
        for user in users:
            self.unhalos[user] = (dim, reach)
            self._place(user, dim, 1)
        return True

    def _on_elementwise(self, node, sharded) -> bool:
        return super()._on_elementwise(node, sharded) or self._outer(node)

    def _outer(self, node) -> bool:
        """An elementwise op of two values holding positions on different dims of its output: an outer op over the
        positions, as attention's scores are (x-transformers' data-dependent ALiBi, ``einx.subtract('b h i, b h j ->
        b h i j', g, g)`` of the forget gates' running sums). The operand with positions on the later dim is
        all-gathered (the keys'), the output holds this rank's positions on the earlier one (the queries')."""
        out = _val(node)
        if not isinstance(out, torch.Tensor):
            return False
        n, placed = out.dim(), {}
        for arg in self._operands(node):
            if arg in self.shard:
                dim, groups = self.shard[arg]
                if groups != 1:
                    return False
                placed.setdefault(dim + n - _val(arg).dim(), []).append(arg)
        if len(placed) != 2:
            return False
        rows, columns = sorted(placed)
        whole = self._lined_up(node, rows)
        if whole is None:
            return False
        for arg in placed[columns]:
            self.gathers.append((node, arg))
        entry = self._entry(placed[rows][0], rows)
        self._beside(node, entry, whole)
        self._place(node, *entry)
        return True

    def _on_along(self, node, sharded) -> bool:
        """A running sum (``cumsum``), product (``cumprod``: gateloop's gates) or log-sum-exp (``logcumsumexp``) along
        the sequence (minGRU's and Heinsen's log-space scan, a cumulative mean, causal linear attention's prefix
        sums): each chunk's own, combined with the totals of every chunk before it (``cp_cumsum``,
        ``cp_logcumsumexp``, ``cp_cumprod``); other ops along it run on the whole sequence."""
        x = node.args[0]
        if node.target in SCANS and sharded == [x] and self.shard[x][1] == 1 and (
                rules.arg(node, 1, "dim") % _val(x).dim() == self.shard[x][0]):
            self.scans[node] = self.shard[x][0]
            self._place(node, *self.shard[x])
            return True
        return super()._on_along(node, sharded)

    def _on_trailing(self, node, sharded) -> bool:
        if node.target in rules.PADS and sharded == [node.args[0]]:
            if self._causal_pad(node):
                return True
            if rules.pads_dim(node, self.shard[node.args[0]][0]):
                before, after = rules.pad_pair(node, self.shard[node.args[0]][0])
                return self._refuse(node, f"pads the sequence dim by ({before}, {after}) positions (before, after): "
                                          f"the positions would move between the cp ranks' chunks (a chunked scan "
                                          f"pads the sequence to a multiple of its chunk: Mamba-2's SSD, gated "
                                          f"delta nets); only a look-back, F.pad(x, (0, 0, s, -s)) or F.pad(x, "
                                          f"(reach, 0)) before a causal conv1d, is spread; split without --cp")
        return super()._on_trailing(node, sharded)

    def _causal_pad(self, node) -> bool:
        """A zero pad of the sequence dim that only looks back: ``F.pad(x, (0, 0, s, -s))``, the sequence shifted by
        ``s`` (x-transformers' and FLASH's token shift, RWKV's ``ZeroPad2d((0, 0, 1, -1))``): each chunk given the
        ``s`` positions before it and its own last ``s`` dropped; or ``F.pad(x, (reach, 0))`` read only by
        unpadded ``conv1d``s of that reach (a causal convolution padded by hand)."""
        x = node.args[0]
        dim, groups = self.shard[x]
        ndim, pad = _val(x).dim(), list(node.args[1])
        at = rules.pad_index(ndim, dim)
        if groups != 1 or len(pad) < at + 2:
            return False
        if node.target is aten.constant_pad_nd.default:
            value = rules.arg(node, 2, "value", 0)
        else:
            value = rules.arg(node, 3, "value", None) if rules.arg(node, 2, "mode", "constant") == "constant" else 1
        before, after = pad[at], pad[at + 1]
        if value not in (None, 0, 0.0) or not isinstance(before, int) or not isinstance(after, int) or before <= 0:
            return False
        if after == -before:
            self.halos[node] = ("shift", dim, before)
            self._place(node, dim, 1)
            return True
        others = pad[:at] + pad[at + 2:]
        users = list(node.users)
        if after != 0 or any(not (isinstance(p, int) and p == 0) for p in others) or dim != ndim - 1 or not users:
            return False

        def convolution(user) -> bool:
            return (user.args[0] is node and rules.conv1d_reach(user) == (0, before)
                    and not any(isinstance(a, fx.Node) and a in self.shard for a in user.args[1:3]))

        if not all(convolution(user) for user in users):
            return False
        self.halos[node] = ("padded", dim, before)
        for user in users:
            self.unhalos[user] = (dim, before)
            self._place(user, dim, 1)
        return True
