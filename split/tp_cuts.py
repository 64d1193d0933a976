"""The tensor-parallel walk's rules for views, cuts and joins of a sharded dim (reshapes into heads, split, slice,
index, cat, an owned split's pieces) and for buffers filled in place (``new_empty`` + ``copy_``): a mixin of
``tp_walk._Walk``."""
from __future__ import annotations

import operator
import sys

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.rules import at as _at, equal as _equal, ints as _ints, prod as _prod, sizes as _sizes, val as _val

aten = torch.ops.aten
TP = torch.ops.tracepp

_END = sys.maxsize  # a slice to the end


class _CutRules:
    """Views, cuts, joins and filled buffers of a sharded dim (methods of ``tp_walk._Walk``)."""

    def _fresh_buffer(self, node, x) -> bool:
        """``x.new_empty(size)`` (new_zeros, new_full) as wide as sharded ``x`` on its sharded dim, filled by
        ``copy_`` into slices of other dims (DeepSeek's MLA writes its keys' no-rotary and rotary parts into one):
        allocated on this rank's piece when every write into it fits that piece as the walk has placed its source so
        far (sharded alike, or whole and broadcast along the dim; a source not yet walked counts as whole); any other
        in-place use keeps it whole."""
        dim, val, xval = self.shard[x], _val(node), _val(x)
        if (self.kind.get(x) == "seq" or x in self.mixed or val.dim() != xval.dim()
                or not _equal(val.shape[dim], xval.shape[dim])
                or not self._local_size(node.args[1], dim, _sizes(val)[dim])):
            return False
        fills = []
        for user in node.users:
            views = [user] if user.target is aten.copy_.default else []
            if user.target in rules.SLICES and user.args[0] is node:
                at = (user.args[1] if len(user.args) > 1 else 0) % val.dim()
                if at == dim:
                    return False
                views = list(user.users)
                if not all(v.target is aten.copy_.default and v.args[0] is user for v in views):
                    return False
            elif not views and rules.writes(user):
                return False  # another in-place write: not followed here
            for write in views:
                if write.args[0] is not node and write.args[0] is not user:
                    return False
                fills.append(write.args[1])
        if not fills or any(self._fits(src, dim, val.dim(), self.segs.get(x)) is None for src in fills):
            return False
        self._place(node, dim, self.segs.get(x), self.origin.get(x, frozenset()))
        return True

    def _fits(self, src, dim: int, ndim: int, segments):
        """How ``src`` is written into a piece of a buffer sharded on ``dim``: "sharded" (sharded alike), "broadcast"
        (size 1 there), "expand" (an expand of such a value read by this write alone: expanded to the piece), or
        None (whole and as wide as the dim)."""
        if not isinstance(src, fx.Node):
            return "broadcast"
        if src in self.shard:
            same = self.shard[src] + ndim - _val(src).dim() == dim and self.segs.get(src) == segments
            return "sharded" if same and self.kind.get(src) != "seq" else None
        sval = _val(src)
        if not isinstance(sval, torch.Tensor):
            return None
        at = dim - (ndim - sval.dim())
        if at < 0 or _equal(sval.shape[at], 1):
            return "broadcast"
        if src.target in rules.EXPANDS and len(src.users) == 1:
            inner = _val(src.args[0])
            at_in = at - (sval.dim() - inner.dim())
            if at_in < 0 or _equal(inner.shape[at_in], 1):
                return "expand"
        return None

    def _fill(self, node) -> bool:
        """``copy_`` into a piece of a buffer allocated on this rank's piece (:meth:`_fresh_buffer`)."""
        dst, src = node.args[0], node.args[1]
        if dst not in self.shard or self.kind.get(dst) == "seq":
            return False
        dim, ndim = self.shard[dst], _val(dst).dim()
        how = self._fits(src, dim, ndim, self.segs.get(dst))
        if how is None:
            return self._refuse(node, f"writes {getattr(src, 'name', src)} into a piece of a buffer sharded on dim "
                                      f"{dim}")
        if how == "expand":  # expanded to this rank's piece only; the gradient of what it expands summed over tp
            self._place(src, dim - (ndim - _val(src).dim()), self.segs.get(dst))
            if self.needs_grad.get(src.args[0]):
                self.copies.append((src, src.args[0]))
        elif how == "broadcast" and isinstance(src, fx.Node) and self.needs_grad.get(src):
            self.copies.append((node, src))
        self._claimed.add((node, src))
        self._carry(node, dst)
        return True

    def _cut(self, node, target, first, dim, in_val) -> bool:
        """split / chunk / unbind / slice / narrow / select: along another dim the sharding is kept; along the
        sharded dim each output must be whole parts of the value's segments (a fused projection's q, k, v): a cut
        elsewhere asks the projection for segments (learned, then walked again)."""
        at = rules.cut_dim(node)
        segments = self.segs.get(first)
        origin = self.origin.get(first, frozenset())
        kind = self.kind.get(first)
        if at != dim and first in self.mixed:
            return self._refuse(node, "cuts a fused projection's output with whole parts along another dim")
        if at != dim:
            out_dim = rules.kept_dim(node, dim)
            if target in rules.SPLITS:
                count = len(_val(node)) if isinstance(_val(node), (list, tuple)) else 0
                self.items[node] = [(out_dim, segments)] * count
            self._place(node, out_dim, segments, origin, kind)
            return True
        if kind == "seq":
            return self._refuse(node, "cuts the sequence dim of a sequence shard")
        size = in_val.shape[dim]
        if self._want_parts(node, target, origin, segments, in_val, dim):
            return False
        if target is aten.select.int and self._owned_select(node, first, dim, size):
            return True
        if target in (aten.select.int, aten.unbind.int) or not _ints([size]):
            return False
        size = int(size)
        ranges = self._ranges(node, target, size)
        if ranges is None:
            return self._refuse(node, "a cut of the sharded dim with a step or a computed size")
        have = rules.boundaries(segments or [size])
        cuts = sorted({p for r in ranges for p in r})
        if not set(cuts) <= set(have):
            wanted = set(cuts) | set(have)
            if first in self.part and self._want_in_part(first, wanted):
                return False
            units = {fqn: _unit(self.out_features.get(fqn), size) for fqn in origin}
            if (any(unit != 1 for unit in units.values()) and target in rules.SPLITS and not segments
                    and self._owned_split(node, dim, size, ranges)):  # heads normalised one by one (StableLM)
                return True
            asked = [bool(unit) and self._want_heads(node, fqn, wanted, unit) for fqn, unit in units.items()]
            if not origin or not all(asked):  # (a dim of heads a view made of the features: unit features a head)
                if target in rules.SPLITS and not segments and self._owned_split(node, dim, size, ranges):
                    return True
                return self._refuse(node, f"cuts {size} sharded features at {cuts[1:-1]}, inside the pieces")
            return False
        pieces = []
        for start, end in ranges:
            inner = [b - a for a, b in zip(have, have[1:]) if a >= start and b <= end]
            pieces.append((dim, tuple(inner) if len(inner) > 1 else None))
        fqn = next(iter(origin)) if len(origin) == 1 and segments else None
        if fqn is not None and not _same_parts(segments, self.fused.get(fqn)):
            fqn = None  # a cut of a range of the projection's parts (Mamba-2's x, B and C after their convolution):
            #             its pieces are not the projection's parts by index, and a part needed whole is gathered
        index_of = {start: k for k, start in enumerate(have[:-1])}
        parts = [(fqn, index_of[start]) if fqn is not None and end - start == int(segments[index_of[start]])
                 else None for start, end in ranges]
        whole = self.mixed.get(first, frozenset())
        if whole:  # a fused output whose whole parts every rank holds in full: local ranges of mixed sizes
            local = [int(p) if k in whole else int(p) // self.tp for k, p in enumerate(segments)]
            bounds = rules.boundaries(local)
            spans = [[k for k in range(len(segments)) if have[k] >= start and have[k + 1] <= end]
                     for start, end in ranges]
            if any(len(ks) > 1 and any(k in whole for k in ks) for ks in spans):
                return self._refuse(node, "cuts a fused projection with whole parts inside its parts")
            self.cuts[node] = [(bounds[ks[0]], bounds[ks[-1] + 1]) for ks in spans]
            # a range of several sharded segments (PaLM's fused projection: the MLP's two halves after q, k, v)
            # holds this rank's piece of each, side by side
            pieces = [None if ks[0] in whole else (dim, tuple(int(segments[k]) for k in ks) if len(ks) > 1 else None)
                      for ks in spans]
            parts = [(fqn, ks[0]) if len(ks) == 1 else None for ks in spans]
            if target not in rules.SPLITS:
                if pieces[0] is None:
                    return self._refuse(node, "takes a whole part of a fused projection by a slice")
                self._place(node, dim, pieces[0][1], origin)
                if parts[0] is not None:
                    self.part[node] = parts[0]
                return True
            self.items[node] = pieces
            self.item_parts[node] = parts
            self._place(node, dim, None, origin)
            return True
        self.cuts[node] = [(start // self.tp, end // self.tp) for start, end in ranges]
        if target in rules.SPLITS:
            self.items[node] = pieces
            self.item_parts[node] = parts
            self._place(node, dim, None, origin)
        else:
            self._place(node, dim, pieces[0][1], origin)
            if parts[0] is not None:
                self.part[node] = parts[0]
        return True

    def _want_in_part(self, value, points) -> bool:
        """``value`` is one part of a fused projection's features (a range of its segments, as a split took it),
        cut at ``points`` of its own (PaLM's MLP half of ``fused_attn_ff_proj``, chunked into its two halves): the
        projection is asked for those points at the part's offset (learned, then walked again). Where the cut dim
        is the part's heads (a view of its features as ``[heads, d]``: sinkhorn-transformer's keys, the first half
        of ``to_kv(x).chunk(2)``, split at half their heads), each point counts a head's features."""
        fqn, index = self.part[value]
        fused = self.fused.get(fqn)
        if not fused or index >= len(fused):
            return False
        part, top = int(fused[index]), int(max(points))
        if top != part and (top <= 0 or part % top or self.segs.get(value)):
            return False
        have = rules.boundaries(fused)
        self.wants.setdefault(fqn, set()).update(have + [have[index] + int(p) * (part // top) for p in points])
        return True

    def _want_heads(self, node, fqn, points, unit: int, width: int = None) -> bool:
        """Ask the projection ``fqn`` for segments cut at ``points`` of a dim whose every index holds ``unit`` of
        its features (a head ``width`` features wide, where ``unit`` > 1: ``unit`` by default, less for keys
        repeated to the query heads); a part of fewer heads than --tp (a segment of one key/value head at --tp 2:
        each rank would hold a piece inside a head) makes it whole instead."""
        points = sorted(points)
        width = width or unit
        if unit > 1 and not set(rules.boundaries(self.fused.get(fqn) or [])) <= {p * unit for p in points}:
            return False  # not a refinement of the segments it has (a dim of pairs, not of heads)
        if unit > 1 and any((b - a) * unit % (width * self.tp) for a, b in zip(points, points[1:])):
            self.unfusable.setdefault(fqn, f"{node.target}{_at(node)} cuts its heads into parts of fewer heads "
                                           f"than --tp {self.tp}")
            return True
        self.wants.setdefault(fqn, set()).update(p * unit for p in points)
        return True

    def _want_parts(self, node, target, origin, segments, in_val, dim: int) -> bool:
        """A cut of a dim a view made by splitting a projection's features into ``[parts, rest]`` (Moshi's gated
        MLP: ``fc1(x).view(b, s, 2, -1)[..., 0, :]``), sharded on the parts: each part the cut takes is a range of
        the projection's features, ``rest`` wide, which the projection is asked to keep as segments (learned,
        then walked again: the view then shards each part)."""
        sizes = [in_val.shape[d] for d in range(dim, in_val.dim())]
        if segments or not origin or not _ints(sizes):
            return False
        size, rest = int(sizes[0]), int(_prod(sizes[1:]))
        if rest == 1 or any(self.out_features.get(fqn) != size * rest for fqn in origin):
            return False
        if target is aten.select.int:
            index = node.args[2] % size
            ranges = [(index, index + 1)]
        elif target is aten.unbind.int:
            ranges = [(k, k + 1) for k in range(size)]
        else:
            ranges = self._ranges(node, target, size)
        if not ranges:
            return False
        wanted = {0, size * rest} | {p * rest for r in ranges for p in r}
        for fqn in origin:
            self.wants.setdefault(fqn, set()).update(wanted)
        return True

    def _want_view_parts(self, value, in_val, out_val, dim: int) -> bool:
        """A view that splits a fused projection's features into ``[parts, rest...]`` with fewer parts than --tp
        divides (timm's and many decoders' ``qkv(x).view(b, s, 3, heads, d)``): the projection is asked to keep
        each part as a segment (learned, then walked again: each rank then holds its heads of every part)."""
        origin = self.origin.get(value, frozenset())
        size, before = in_val.shape[dim], _prod(list(in_val.shape[:dim]))
        if self.segs.get(value) or not origin or not _ints([size, before]):
            return False
        sizes = list(out_val.shape)
        for e in range(len(sizes)):
            if not _ints(sizes[:e + 1]) or int(_prod(sizes[:e])) != int(before):
                continue
            parts, size = int(sizes[e]), int(size)
            if parts == 1:  # a dim of 1 before the parts (a batch of one: nn.MultiheadAttention's [seq, 1, 3, e])
                continue
            if parts < 2 or parts % self.tp == 0 or size % parts or (size // parts) % self.tp:
                return False
            if any(self.out_features.get(fqn) != size for fqn in origin):
                return False
            for fqn in origin:
                self.wants.setdefault(fqn, set()).update(k * (size // parts) for k in range(parts + 1))
            return True
        return False

    @staticmethod
    def _ranges(node, target, size: int):
        """The [start, end) ranges of the sharded dim each output of a cut takes (global), or None."""
        args = node.args
        if target is aten.slice.Tensor:
            start = args[2] if len(args) > 2 else node.kwargs.get("start", 0)
            end = args[3] if len(args) > 3 else node.kwargs.get("end", _END)
            step = args[4] if len(args) > 4 else node.kwargs.get("step", 1)
            if step != 1 or not all(v is None or isinstance(v, int) for v in (start, end)):
                return None
            start, end = (0 if start is None else start), (size if end is None else end)
            start = max(0, min(size, start + size if start < 0 else start))
            end = max(start, min(size, end + size if end < 0 else end))
            return [(start, end)]
        if target is aten.narrow.default:
            start, length = args[2], args[3]
            if not (isinstance(start, int) and isinstance(length, int)):
                return None
            start = start + size if start < 0 else start
            return [(start, start + length)]
        if target is aten.chunk.default:
            each = -(-size // args[1])
            sizes = [min(each, size - k) for k in range(0, size, each)]
        elif target is aten.split.Tensor:
            if not isinstance(args[1], int):
                return None
            sizes = [min(args[1], size - k) for k in range(0, size, args[1])]
        else:
            sizes = list(args[1])
            if not all(isinstance(s, int) for s in sizes):
                return None
        bounds = rules.boundaries(sizes)
        return list(zip(bounds, bounds[1:]))

    def _owned_select(self, node, first, dim: int, size) -> bool:
        """``x.select(dim, i)`` of the sharded dim, read whole (x-transformers' selective attention: head 0's scores
        gate every head's): the rank whose piece holds index ``i`` takes it, the others zeros, and ``tp_all_reduce``
        makes it whole (``tp_owned_select``; the bytes of one index, where a gather moves the whole dim). In
        segments (heads tiled for grouped-query attention) the index is found in its segment's pieces."""
        index = rules.arg(node, 2, "index")
        segments = self.segs.get(first) or (size,)
        if (first in self.mixed or not _ints(list(segments)) or not isinstance(index, int) or not _ints([size])
                or any(int(s) % self.tp for s in segments)):
            return False
        if 2 * len(self._indices_taken(first, dim, int(size))) >= int(size):
            return False  # the indices taken one by one (Zamba's Mamba heads, scanned each in turn) move more as
            #               all-reduces of one index each than one gather of the whole dim: gathered, or made whole
        index, start, local = index % int(size), 0, 0
        for length in (int(s) for s in segments):
            per = length // self.tp
            if index < start + length:
                self.owned_selects[node] = (dim, local + (index - start) % per, (index - start) // per)
                break
            start, local = start + length, local + per
        self.sums[node] = None
        self._claimed.add((node, first))
        return True

    @staticmethod
    def _indices_taken(value, dim: int, size: int) -> set:
        """The indices of ``value``'s dim ``dim`` that its users take one by one (``select``; an ``unbind`` of the dim
        takes them all)."""
        taken = set()
        for user in value.users:
            if user.target not in (aten.select.int, aten.unbind.int) or rules.cut_dim(user) != dim:
                continue
            if user.target is aten.unbind.int:
                return set(range(size))
            index = rules.arg(user, 2, "index")
            taken.add(index % size if isinstance(index, int) else user)
        return taken

    def _owned_split(self, node, dim: int, size: int, ranges) -> bool:
        """A split of the sharded dim into pieces no larger than a rank's (StableLM's per-head LayerNorms: the
        heads split one by one, each normalised by its own module of a ModuleList, then joined again): each piece
        lies inside one rank's block, and that rank computes it while the others hold it empty (``tp_owned_split``);
        what each piece goes through must be per-piece (casts, elementwise ops with operands broadcast along the
        dim, norms over other dims) and end in one ``cat`` of the pieces in order along the dim, whose result is
        sharded as the split's input was. A weight a piece reads is whole on every rank, its gradient summed over
        tp (the other ranks' parts are zero)."""
        if self.kind.get(node.args[0]) == "seq":
            return False
        per = size // self.tp
        owners = []
        for start, end in ranges:
            owner = start // per
            if end <= start or end > (owner + 1) * per:
                return False
            owners.append(owner)
        items = {user.args[1]: user for user in node.users if user.target is operator.getitem}
        if sorted(items) != list(range(len(ranges))) or len(items) != len(node.users):
            return False
        chain, ends = {}, []
        for index in range(len(ranges)):
            value = items[index]
            chain[value] = owners[index]
            while True:
                users = list(value.users)
                if len(users) != 1:
                    return False
                user = users[0]
                if user.target in rules.CATS:
                    ends.append((value, user))
                    break
                if not self._per_piece(user, value, dim):
                    return False
                chain[user] = owners[index]
                value = user
        cats = {cat for _value, cat in ends}
        if len(cats) != 1:
            return False
        cat = next(iter(cats))
        ndim = _val(node.args[0]).dim()
        if list(cat.args[0]) != [value for value, _cat in ends] or (cat.args[1] if len(cat.args) > 1 else 0) % ndim != dim:
            return False
        self.owned_splits[node] = [end - start for start, end in ranges]
        self.owned.update(chain)
        self.owned_cats[cat] = (dim, self.origin.get(node.args[0], frozenset()))
        return True

    def _per_piece(self, node, value, dim: int) -> bool:
        """``node`` computes each element of ``value`` along ``dim`` on its own: a cast, an elementwise op whose
        other operands are broadcast along ``dim``, a norm over other dims."""
        target = node.target
        ndim = _val(value).dim()
        if target in rules.UNARY and target is not aten.dropout.default:
            return node.args[0] is value
        if target is aten.type_as.default:
            return node.args[0] is value
        if target in rules.NORMS:
            return node.args[0] is value and dim < ndim - len(node.args[1])
        if target in rules.BINARY:
            for arg in node.args:
                if arg is value or not isinstance(arg, fx.Node):
                    continue
                val = _val(arg)
                if not isinstance(val, torch.Tensor):
                    continue
                at = dim - (_val(node).dim() - val.dim())
                if at >= 0 and not _equal(val.shape[at], 1):
                    return False
            return True
        return False

    def _index(self, node, first, dim, in_val, out_val) -> bool:
        """``x[..., idx]``: advanced indexing of other dims keeps the sharded dim (it may move)."""
        indices = list(node.args[1])
        e = rules.indexed_dim(node, dim)
        if e is None or any(isinstance(i, fx.Node) and i in self.shard for i in indices):
            return False
        if not (0 <= e < out_val.dim()) or not _equal(_sizes(out_val)[e], _sizes(in_val)[dim]):
            return False
        self._carry(node, first, e)
        return True

    def _cat(self, node) -> bool:
        parts = [p for p in node.args[0] if not rules.skipped_by_cat(p)]
        if not parts:
            return False
        ndim = _val(parts[0]).dim()
        at = (node.args[1] if len(node.args) > 1 else 0) % ndim
        dims = {self.shard.get(p) for p in parts if p in self.shard}
        if len(dims) != 1:
            return False
        dim = next(iter(dims))
        origin = self._origin_of(parts)
        whole = [p for p in parts if p not in self.shard]
        if whole:  # along another dim, a whole part as wide as the sharded dim (GPT-OSS's attention sinks beside
            #        the scores of each head) is read at this rank's piece; its gradient pieces are gathered back
            segments = {self.segs.get(p) for p in parts if p in self.shard}
            groups = self.groups_of(next(iter(segments))) if len(segments) == 1 else 0
            if at == dim or not groups or self._kind_of(parts) != "tp" or any(
                    _val(p).dim() != ndim or not _equal(_val(p).shape[dim], _val(parts[0] if parts[0] in self.shard else
                                                         next(q for q in parts if q in self.shard)).shape[dim])
                    for p in whole):
                return False
            self._read_whole(node, [(p, dim) for p in whole], groups)
        if at == dim and len(parts) == 1:  # a cat of one part (einops' pack([t], ...)): the part as it is
            self._place(node, dim, self.segs.get(parts[0]), origin, self._kind_of(parts))
            return True
        if at == dim:  # pieces of each part side by side: the parts are the segments
            segments = []
            for part in parts:
                segments.extend(self.segs.get(part) or [_sizes(_val(part))[dim]])
            if not _ints(segments):
                return False
            if self._kind_of(parts) == "seq":
                return False
            self._place(node, dim, tuple(int(s) for s in segments), origin)
            return True
        sharded = [p for p in parts if p in self.shard]  # a whole part is read at this rank's piece of each segment
        if len({self.segs.get(p) for p in sharded}) != 1:  # (x-transformers' sink beside scores of tiled heads)
            return False
        self._place(node, dim, self.segs.get(sharded[0]), origin, self._kind_of(parts))
        return True

    def _on_view(self, node, sharded) -> bool:
        first = node.args[0]
        if first not in self.shard or len(sharded) != 1:
            return False
        dim, in_val, out_val = self.shard[first], _val(first), _val(node)
        placed = rules.view_placement(_sizes(in_val), _sizes(out_val), dim, self.segs.get(first), self.tp)
        if placed is not None and node.target in rules.UNFLATTENS:  # unflatten(d, sizes): the sizes of d's dims
            at = node.args[1] % in_val.dim()
            if not self._local_size(node.args[2], placed[0] - at, _sizes(out_val)[placed[0]]):
                placed = None
        if placed is not None and self.kind.get(first) == "seq" and not self.groups_of(placed[1]):
            placed = None
        if placed is None and self._unit_dim_view(node, in_val, out_val, dim):
            if self._one_group_view(node):
                placed = (dim + 1, self.segs.get(first))
            else:  # a head of one (a multi-query key, Mamba-2's B and C shared by every head): needed whole,
                self.heads_of_one.add(node)  # not cut inside the head as torch's rule for the view would
        if placed is None or (node.target in rules.VIEWS and not self._local_size(node.args[1], placed[0],
                                                                                _sizes(out_val)[placed[0]])):
            if placed is None and self._want_view_parts(first, in_val, out_val, dim):
                return False  # asked for the parts as segments (learned, then walked again)
            self._whole_part(first)
            if node in self.heads_of_one:
                return self._refuse(node, f"makes one head of {in_val.shape[dim]} features sharded over --tp "
                                          f"{self.tp} ({list(out_val.shape)}): fewer heads than --tp (as a "
                                          f"multi-query or grouped-query key/value head, or one group's state "
                                          f"shared by every head: Mamba-2's B and C), gathered whole")
            return self._refuse(node, f"reshapes a dim of {in_val.shape[dim]} sharded over --tp {self.tp} "
                                      f"into {list(out_val.shape)}, whose pieces would not be whole heads "
                                      f"(fewer heads than --tp, e.g. key/value heads of grouped-query "
                                      f"attention)")
        self._place(node, placed[0], placed[1], self.origin.get(first, frozenset()), self.kind.get(first))
        return True

    def _unit_dim_view(self, node, in_val, out_val, dim: int) -> bool:
        """A view that puts a dim of 1 before the sharded last dim (``[b, s, d] -> [b, s, 1, d]``)."""
        ins, outs = _sizes(in_val), _sizes(out_val)
        return (self.kind.get(node.args[0]) != "seq" and len(outs) == len(ins) + 1 and dim == len(ins) - 1
                and _equal(outs[dim], 1) and all(_equal(a, b) for a, b in zip(ins[:dim], outs[:dim]))
                and _equal(ins[dim], outs[dim + 1]))

    def _one_group_view(self, node) -> bool:
        """A :meth:`_unit_dim_view` whose every use is elementwise or reduced over its last dim, until a view
        takes the dim of 1 away again: a norm over one group of every head's features (the gated RMSNorm after a
        Mamba-2 scan with ``n_groups`` 1: ``view(b, s, 1, d)``, its statistics, ``view(b, s, d)``). The dim of 1 is
        one group, not a head: the shard stays on the features, and the norm's statistics are partial sums. A dim
        of 1 that goes on to be repeated, expanded, transposed or attended over (a multi-query key's one head, with
        its norm over the head's features: Qwen3's ``k_norm``; Mamba-2's B and C, shared by every head) is a head,
        whose features a rank cannot hold in part: that view is refused, its input gathered."""
        last = _val(node).dim() - 1
        whole = list(_sizes(_val(node.args[0])))
        stack, seen, merged = list(node.users), set(), False
        while stack:
            user = stack.pop()
            if user in seen or user.target in rules.IGNORED:
                continue
            seen.add(user)
            val = _val(user)
            if user.target in rules.VIEWS and isinstance(val, torch.Tensor) and _val(user.args[0]).dim() == last + 1:
                if len(_sizes(val)) != len(whole) or not all(_equal(a, b) for a, b in zip(_sizes(val), whole)):
                    return False
                merged = True  # the group's dim taken away again
                continue
            if isinstance(val, torch.Tensor) and val.dim() != last + 1:
                return False
            if user.target in rules.REDUCTIONS_BY_DIM:
                dims = rules.arg(user, 1, "dim")
                if not isinstance(dims, (list, tuple)) or [d % (last + 1) for d in dims] != [last]:
                    return False
            elif user.target not in rules.BINARY and user.target not in rules.UNARY:
                return False
            stack += list(user.users)
        return merged

    def _local_size(self, sizes, e: int, out_size) -> bool:
        """A view/expand's size list can be rewritten to the local size at dim ``e``: -1 there, or the global
        size as a literal int."""
        if not isinstance(sizes, (list, tuple)) or e >= len(sizes):
            return False
        at = sizes[e]
        return at == -1 or (isinstance(at, int) and _ints([out_size]) and at == int(out_size))


def _same_parts(segments, fused) -> bool:
    """``segments`` are a fused projection's parts ``fused``, in its features or in heads of one width (its output
    viewed as heads and split by head counts: ring-attention's ``(heads, kv_heads, kv_heads)``)."""
    if not fused or len(segments) != len(fused):
        return False
    mine, theirs = [int(s) for s in segments], [int(p) for p in fused]
    return theirs[0] % mine[0] == 0 and all(p == s * (theirs[0] // mine[0]) for s, p in zip(mine, theirs))


def _unit(features, size: int):
    """How many of a projection's ``features`` one index of a sharded dim of ``size`` holds (1: the features
    themselves; a head's width: a dim of heads a view made of them), or None where ``size`` does not divide them."""
    return int(features) // size if features and int(features) % size == 0 else None
