"""The tensor-parallel walk (``tensor_parallel``'s step one): one pass over one stage graph, in order, placing each
value whole or sharded on one dim under a set of replicated parameters and what earlier passes learned (fused
projections' segments, whole parts, pieces). The op rules it asks are ``split.rules``; this class decides what a
placement means for tp: the collectives, the parameters' shards, the refusals with their reasons. Linears,
embeddings and attention are in ``tp_contract``, views, cuts, joins and buffers in ``tp_cuts``; the fixed point over the
passes is ``tp_settle``, the rewrite ``tp_rewrite``."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import tracepp.runtime.tensor_parallel  # noqa: F401  (registers torch.ops.tracepp.tp_*)
from tracepp.split import decompose, rules, torch_rules, tp_head_loop, tp_partial
from tracepp.split.derived_weights import _rearranged, cut_segments, reads_as_weight, sizes_kept, steps_of, values_only
from tracepp.split.propagation import Propagation
from tracepp.split.rules import at as _at, equal as _equal, ints as _ints, prod as _prod, sizes as _sizes, val as _val
from tracepp.split.tp_contract import _ContractionRules, _swapped
from tracepp.split.tp_cuts import _CutRules

aten = torch.ops.aten
TP = torch.ops.tracepp
NORM_OVER_SHARD = "normalises over the sharded dim"  # a norm's refusal: tensor_parallel.plan writes it out, prices that

_MIXED_CARRIES = {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.transpose.int, aten.permute.default,
                  aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.contiguous.default,
                  aten.alias.default}  # metadata checks: dropped by codegen
WORK = {"visits": 0}  # nodes the walks have visited (tests count the work of a plan, not its time)


_SUMS = {aten.add.Tensor, aten.sub.Tensor}  # a residual add: the stream beside a sharded output (read on) stays whole


class _Walk(Propagation, _CutRules, _ContractionRules):
    """One pass over one stage graph under a set of replicated FQNs and the segments learned for fused
    projections: each value's placement and the edits."""

    WORK = WORK

    def __init__(self, graph: fx.Graph, fqn_of: dict, tp: int, forced: set, needs_grad: dict,
                 fused: dict = None, sequence=None, received: dict = None, last: bool = False, mixed: dict = None,
                 whole_buffers: dict = None, gathered: dict = None, pieces: dict = None, local_sources: dict = None):
        self.graph, self.fqn_of, self.tp, self.forced = graph, fqn_of, tp, forced
        self.local_sources = local_sources or {}  # name -> dim: an expand or repeat of a dim of 1 whose value is
        #                                           read only at this rank's piece: made on the piece (learned)
        self.pieces = pieces or {}  # fqn -> dim, or (dim, segments): a parameter sharded where it is made (learned:
        #                             _learn_pieces)
        self.heads_of_one: set = set()  # views making a head of one of a sharded dim: gathered (_unit_dim_view)
        self.repieces: dict = {}  # a held parameter's value met in pieces of other segments -> those (or None)
        self.gathered = gathered or {}  # FQNs of low-rank down-projections sharded with their output gathered
        self.gathered_out: dict = {}  # such a linear's output -> its shard dim: gathered once, for every user
        self.whole_buffers = whole_buffers or {}  # names of values written in place where a shard cannot be: kept whole
        self.buffers_wanted: dict = {}  # such a value found in this pass -> why
        self.mixed_parts = mixed or {}  # fused weight fqn -> indices of its parts computed whole (learned)
        self.mixed: dict = {}  # a fused output with whole parts (and what carries it) -> those parts' indices
        self.mixed_linears: dict = {}  # such a linear -> (input, weight, bias, out_dim, segments, whole parts)
        self.part: dict = {}  # a value cut from one part of a fused projection -> (weight fqn, part index)
        self.item_parts: dict = {}  # a cut of a fused projection -> per output its (fqn, part index) or None
        self.whole_parts: dict = {}  # fqn -> parts found needed whole in this pass (kv heads fewer than tp)
        self.needs_grad = needs_grad  # node -> carries a gradient (split.partition._gradient_flags)
        self.fused = fused or {}  # weight fqn -> segments of its output features (learned in an earlier pass)
        self.shard: dict = {}  # node -> sharded dim (absent: replicated)
        self.segs: dict = {}  # sharded node -> segments of that dim (absent: one)
        self.items: dict = {}  # a split's node -> per output (dim, segments) or None
        self.origin: dict = {}  # sharded node -> frozenset of the column-wise weight FQNs it comes from
        self.out_features: dict = {}  # column-wise weight fqn -> its output features
        self.roles: dict = {}  # linear/embedding node -> "colwise" | "rowwise" | "vocab"
        self.bags: dict = {}  # embedding_bag of a table sharded by rows -> its bags' sums (output 0: in ``sums``)
        self.forms: dict = {}  # linear node -> (input, weight node, bias node, weight's output-feature dim)
        self.aliases: dict = {}  # transpose of a 2-D parameter -> its placeholder
        self.chains: dict = {}  # a linear's weight or bias rearranged from one parameter (_chain) -> its placeholder
        self.companions: dict = {}  # such a weight made of several parameters -> the others' placeholders
        self.uses: dict = {}  # fqn -> set of dims (None: used replicated)
        self.param_segments: dict = {}  # fqn -> segments of its sharded dim
        self.gathers: list = []  # (consumer node, input node)
        self.copies: list = []  # (consumer node, replicated input node)
        self.sums: dict = {}  # partial sums all-reduced after them: a mean/sum over the sharded dim -> count of the
        #                     reduced elements (mean) or None; None for a partial product and an owned select
        self.maxes: set = set()  # maxima over the sharded dim: each rank's, all-reduced by MAX (tp_amax)
        self.cuts: dict = {}  # split/slice on the sharded dim -> the local pieces' arguments
        self.wants: dict = {}  # weight fqn -> set of cut points its output's consumers need (fused projections)
        self.unfusable: dict = {}  # weight fqn -> why its segmented output cannot be cut locally
        self.reasons: list = []
        # sequence parallelism: the traced sequence length (None: off), the received values that arrive as
        # sequence shards (placeholder name -> (dim, segments)), and what it adds
        self.sequence, self.received = sequence, received or {}
        self.kind: dict = {}  # sharded node -> "seq" for a sequence shard (absent: a tensor-parallel shard)
        self.reduce_scatters: dict = {}  # row-wise linear / vocabulary lookup -> (dim, groups) of its output
        self.sp_gathers: list = []  # (column-wise linear, its sequence-sharded input)
        self.scatters: list = []  # (consumer, whole input, dim of the input, groups): cut to this rank's piece
        self.head_groups: list = []  # (attention, whole key/value, head dim, head count): the group this rank needs
        self.owned_splits: dict = {}  # split of the sharded dim into pieces within ranks -> the pieces' sizes
        self.owned: dict = {}  # a piece (and what it goes through) -> the rank that computes it
        self.owned_cats: dict = {}  # the cat joining the pieces -> (dim, origin): sharded again
        self.loop_live: dict = {}  # an op of a loop over sharded heads that this rank runs -> its local head
        self.loop_dead: set = set()  # an op of such a loop on another rank's heads: dropped
        self.loop_joins: dict = {}  # the join of such a loop's heads -> (its dim, origin, heads kept): sharded
        self.owned_selects: dict = {}  # select of one index of the sharded dim -> (dim, index in the
        #                                owner's piece, owner): the owner's, the others' zeros, summed
        self.conv_groups: dict = {}  # depthwise convolution over sharded channels -> its local groups
        self.group_norms: dict = {}  # group_norm over channels sharded in whole groups -> its local groups
        self._made_of_params: dict = {}  # node -> computed from parameters alone (memo of _param_only)
        self.sends: dict = {}  # sequence-sharded value leaving the stage -> (dim, segments)
        self._claimed: set = set()  # (node, input) pairs a rule placed (no "whole" use recorded)
        self.last = last  # the last stage: its outputs go to the loss, whole
        self.chain_steps = self._rearranged_weights(graph)
        self._loops = tp_head_loop.find(graph)  # loops over heads, by their first op (entered where met)
        self._walk(graph)
        del self._loops
        tp_partial.defer(self)  # deferred, late_sums, partial: where row-wise partial sums are all-reduced

    # -- helpers
    def _rearranged_weights(self, graph) -> set:
        """The linears' weights and biases rearranged from a parameter on every call (``tp_contract._chain``), found
        before the walk: each and the steps between it and its parameter (each read only by the steps after it, the last by
        linears alone), which the walk leaves to the linears' claims rather than reading the parameter whole there."""
        for node in graph.nodes:
            if node.op == "call_function" and node.target is aten.linear.default:
                for arg in node.args[1:3]:
                    self._read_through(arg)
            elif node.op == "call_function" and node.target in rules.CONVS:
                self._channel_linear(node)
            elif node.op == "call_function" and node.target is aten.einsum.default and len(node.args[1]) == 2:
                for arg in node.args[1]:  # a weight viewed with batch labels (tp_contract._batched_einsum_linear)
                    self._read_through(arg)
        ways = {end: [step for step in steps_of(end)[1:] if step.op != "placeholder"] for end in self.chains}
        every = set(ways) | {step for mine in ways.values() for step in mine}  # a split's parts: each another end's
        steps: set = set()
        for end, mine in ways.items():
            linears_only = all(reads_as_weight(user, end) for user in end.users)
            if linears_only and all({u for u in step.users if u.target not in rules.IGNORED and (
                    u.users or u.target is not operator.getitem)} <= every for step in mine):  # (unread indices)
                steps.update(mine + [end])
            else:  # a step read elsewhere too: read as the walk finds it
                del self.chains[end]
                self.companions.pop(end, None)
        return steps

    def _param(self, node):
        if not isinstance(node, fx.Node):
            return None
        if node in self.aliases:
            node = self.aliases[node]
        elif node in self.chains:
            node = self.chains[node]
        return self.fqn_of.get(node.name) if node.op == "placeholder" else None

    def _use(self, node, dim, segments=None) -> None:
        fqn = self._param(node)
        if fqn is None:
            return
        if node in self.aliases and dim is not None:  # a transposed weight: its last two dims swap
            dim = _swapped(dim, _val(node).dim())
        elif node in self.chains and dim is not None:  # a rearranged weight: its dim traced back, the way placed
            way = _rearranged(node, dim, self.tp)
            others = self.companions.get(node, [])
            if way is not None and others:  # a weight of several parameters: each traced, as long on its dim
                found = dict(way)
                way = [(step, at) for step, at in way if step not in others]
                length = _val(way[-1][0]).shape[way[-1][1]]
                if (any(self._param(p) in self.forced or p not in found for p in others)
                        or any(not _equal(_val(p).shape[found[p]], length) for p in others)):
                    way = None
            cut = cut_segments(way, segments, self.tp) if way is not None else False
            if others and cut:  # parts cut on the way: not with several parameters
                cut = False
            if cut is False or ((segments or cut) and not sizes_kept(way, cut)):
                dim = None  # segments of a dim a view regroups on the way, or parts not cut into pieces
            else:
                for other in others:  # held as the weight's own parameter is: on its dim, in its segments
                    self.uses.setdefault(self._param(other), set()).add(found[other])
                    if segments:
                        self.param_segments[self._param(other)] = tuple(int(s) for s in segments)
                for step, at in way[:-1]:
                    if at is not None:
                        self.shard[step] = at
                    elif step.target in rules.PARTIAL:  # a reduction of the rank's piece scaling the weight: whole
                        self._combine(step)               # once combined (derived_weights.whole_scale)
                dim = way[-1][1]
                for split, sizes in cut.items():
                    bounds = rules.boundaries(sizes)
                    self.cuts[split] = [(a // self.tp, b // self.tp) for a, b in zip(bounds, bounds[1:])]
                    self.items[split] = [(self.shard[split], None)] * len(sizes)
                    segments = sizes
        if dim is None:  # the weight whole: so are the parameters made into it beside its own
            for other in self.companions.get(node, []):
                self.uses.setdefault(self._param(other), set()).add(None)
        self.uses.setdefault(fqn, set()).add(dim)
        if dim is not None and segments:
            self.param_segments[fqn] = tuple(int(s) for s in segments)

    def _claim(self, node, arg, dim=None, segments=None) -> None:
        self._claimed.add((node, arg))
        self._use(arg, dim, segments)

    def _place(self, node, dim, segments=None, origin=frozenset(), kind=None) -> None:
        parts = {self.part[a] for a in node.all_input_nodes if a in self.part}
        if len(parts) == 1 and node not in self.part:
            self.part[node] = next(iter(parts))
        self.shard[node] = dim
        if segments:
            self.segs[node] = tuple(segments)
        if origin:
            self.origin[node] = frozenset(origin)
        if kind == "seq":
            self.kind[node] = "seq"

    def _kind_of(self, args) -> str:
        """The placement kind shared by the sharded ``args`` ("seq" or "tp"), or None where they differ."""
        kinds = {self.kind.get(a, "tp") for a in args if isinstance(a, fx.Node) and a in self.shard}
        return next(iter(kinds)) if len(kinds) == 1 else None

    @staticmethod
    def groups_of(segments) -> int:
        """The equal segments of a sequence shard ([batch * seq] of tokens): their count, else 0 (unequal)."""
        if not segments:
            return 1
        return len(segments) if len(set(segments)) == 1 else 0

    def _origin_of(self, args) -> frozenset:
        out = frozenset()
        for arg in args:
            out |= self.origin.get(arg, frozenset())
        return out

    def _carry(self, node, source, dim=None) -> None:
        """``node`` sharded as ``source`` is (on ``dim`` where the op moved it)."""
        self._place(node, self.shard[source] if dim is None else dim, self.segs.get(source),
                    self.origin.get(source, frozenset()), self.kind.get(source))
        if source in self.mixed:
            self.mixed[node] = self.mixed[source]

    def _dim(self, node) -> int:
        return self.shard[node]

    def _ranks(self) -> int:
        return self.tp

    def _entry(self, node, dim=None):
        return (self.shard[node] if dim is None else dim, self.segs.get(node))

    def _across(self, node, what: str) -> bool:
        return False  # torch's rule is asked, else the input is gathered (``_visit``)

    def _partial(self, node, kind: str, dims: list) -> bool:
        """A sum or mean over named dims, the sharded one among them, is combined from the partial sums
        (:meth:`_partial_sum`); any other partial kind goes to torch's rule (a p-norm's ``_NormPartial`` is
        reduced as what it is, ``torch_rules``), else the input is gathered. A vector p-norm is a norm over the
        sharded dim: ``tensor_parallel.plan`` tries it written out (a partial sum of ``|x|^p``)."""
        if node.target is aten.linalg_vector_norm.default and decompose.order(node) is not None:
            return self._refuse(node, NORM_OVER_SHARD)
        if kind in ("max", "min") and self._values_only(node):
            self.maxes.add(node)  # each rank's maximum (minimum), all-reduced by MAX (``tp_amax``, of -x): whole
            return True
        if node.target not in rules.REDUCTIONS_BY_DIM or not rules.arg(node, 1, "dim"):
            return False
        return self._partial_sum(node, node.target, _val(node.args[0]), dims)

    def _combine(self, node) -> None:
        """A reduction over the sharded dim of a derived weight's piece: all-reduced (a sum; a mean divided by the
        whole count), or by MAX."""
        if rules.partial_kind(node) in ("max", "min"):
            self.maxes.add(node)
            return
        dims = rules.reduction(node)[0]
        count = _prod([_sizes(_val(node.args[0]))[d] for d in dims])
        self.sums[node] = count if rules.partial_kind(node) == "mean" else None

    @staticmethod
    def _values_only(node) -> bool:
        """A maximum (minimum) whose values alone are read (``amax``; ``max(x, dim)`` whose indices nothing reads:
        they would be of this rank's piece): the ranks' maxima make the whole one. BitNet's activations quantized by
        their largest magnitude over the features, before a row-wise linear that reads them sharded on the features;
        an asymmetric quantizer's ``amin`` and ``amax`` of each token."""
        if node.target in (aten.amax.default, aten.max.default, aten.amin.default, aten.min.default):
            return True
        return node.target in (aten.max.dim, aten.min.dim) and values_only(node)

    def _whole_part(self, value) -> None:
        """``value``, cut from one part of a fused projection, is needed whole (a key/value part with fewer heads
        than --tp): the next pass computes that part whole and shards the others."""
        if value in self.part:
            fqn, index = self.part[value]
            self.whole_parts.setdefault(fqn, set()).add(index)

    def _gather(self, consumer, arg) -> None:
        self.gathers.append((consumer, arg))
        # a fused projection's parts are joined part by part (tp_rewrite._gathered), unless some are whole
        if arg in self.segs and self.kind.get(arg) != "seq" and arg in self.mixed:
            for fqn in self.origin.get(arg, ()):
                self.unfusable.setdefault(fqn, f"its parts are needed whole by {consumer.target}{_at(consumer)}")

    def _gathered_cheaper(self, node, sharded) -> bool:
        """A product over the sharded dim whose partial sums (all-reduced) are larger than its operands: one head's
        scores ``q @ k.transpose(-2, -1)`` where each head is a module of its own (Karpathy's ``Head`` of a
        ``ModuleList``: the head's features sharded, ``[b, t, t]`` all-reduced for each head, twice Megatron's
        bytes at ``t`` of 256 and heads of 64). Gathered where the operands' all-gathers and the product computed
        whole on every rank (``plan_cost``'s FLOPs a byte) cost less than the all-reduce; a column-wise projection
        whose output is then gathered before any row-wise linear is computed whole on the next pass."""
        from tracepp.split.cost import tensor_bytes
        from tracepp.split.plan_cost import FLOPS_PER_BYTE

        if node.target not in rules.PRODUCTS:
            return False
        out = _val(node)
        inner = _val(sharded[0]).shape[self.shard[sharded[0]]]
        if not isinstance(inner, int) or not all(isinstance(size, int) for size in out.shape):
            return False
        reduced = 2 * tensor_bytes(out)  # all-reduced forward, as plan_cost prices it (nothing backward)
        gathered = sum(tensor_bytes(_val(arg)) for arg in sharded)  # all-gathered forward, sliced backward
        whole = 2 * out.numel() * inner * (self.tp - 1) / self.tp / FLOPS_PER_BYTE  # the product left whole
        return gathered + whole < reduced

    def _gather_all(self, node) -> None:
        for arg in node.all_input_nodes:
            if arg in self.shard:
                self._gather(node, arg)

    def _enter_loop(self, loop) -> None:
        """A loop over heads (``split.tp_head_loop``) whose heads are sharded, each in this rank's block: this rank
        runs the first ``heads / tp`` heads' ops, on its own heads (a whole value whose heads are taken is read at
        the rank's piece first), drops the rest, and its join of the heads kept is its piece of the joined value."""
        if loop.heads % self.tp:
            return
        sharded = [value for value in loop.taken if value in self.shard]
        if not sharded or any(self.shard[value] != loop.taken[value] or self.segs.get(value) or value in self.mixed
                              or self.kind.get(value) == "seq" for value in sharded):
            return
        kept = loop.heads // self.tp
        for head, chain in enumerate(loop.chains):
            for node in chain:
                if head < kept:
                    self.loop_live[node] = head
                else:
                    self.loop_dead.add(node)
        for (value, head), select in loop.selects.items():
            if head < kept and value not in self.shard:
                self.scatters.append((select, value, loop.taken[value], 1))
                self._claimed.add((select, value))
        origin = frozenset().union(*(self.origin.get(value, frozenset()) for value in sharded))
        for join, dim in loop.joins.items():
            self.loop_joins[join] = (dim, origin, kept)

    def on_shards(self, node) -> bool:
        """``node`` is computed on this rank's piece: a sharded value, a row-wise linear, an op of a loop over
        sharded heads (this rank's heads, or another rank's, not run here)."""
        return (node in self.shard or self.roles.get(node) == "rowwise" or node in self.loop_live
                or node in self.loop_dead)

    def _own_reads(self, node, inside) -> None:
        """``node`` computed by a rank on its own piece (an owned split's piece, a loop's own heads): a value it reads
        that is not ``inside`` its piece's ops and carries a gradient gets only this rank's part of that gradient,
        summed over tp (``tp_copy``); the rest it reads whole."""
        for arg in node.all_input_nodes:
            if not inside(arg) and self.needs_grad.get(arg):
                self.copies.append((node, arg))
        self._use_whole(node)

    def _use_whole(self, node) -> None:
        for arg in node.all_input_nodes:
            if arg not in self.shard and (node, arg) not in self._claimed:
                self._use(arg, None)

    def _refuse(self, node, why: str) -> bool:
        self.reasons.append(f"{node.name} ({node.target}){_at(node)}: {why}")
        return False

    def _sent_as_heads(self, value) -> bool:
        """A value sharded on a dim before its last (heads: CPM-Ant's position bias ``[b, heads, q, k]``, sent to
        every later layer) in equal pieces, and not in pieces of a fused projection's parts: sent to the next stage as
        it is, which reads it at its heads (or gathers it where it needs it whole) where this stage would gather it
        for the boundary. The residual stream (sharded on its features, the last dim) is gathered as before."""
        val = _val(value)
        segments = self.segs.get(value)
        return (isinstance(val, torch.Tensor) and self.shard[value] < val.dim() - 1 and value not in self.part
                and bool(self.groups_of(segments)))

    # -- the rules
    def _visit(self, node) -> None:
        if node.op == "placeholder":
            if node.name in self.received:  # a shard sent by the stage before: of the sequence, or of heads
                dim, segments, kind = self.received[node.name]
                self._place(node, dim, segments, kind=kind)
            fqn = self.fqn_of.get(node.name)
            if fqn in self.pieces and fqn not in self.forced:  # read at its piece by what it makes: sharded
                dim, segments = self.pieces[fqn] if isinstance(self.pieces[fqn], tuple) else (self.pieces[fqn], None)
                self._place(node, dim, segments)
                self._use(node, dim, segments)
            return
        if node.op == "output":
            for arg in node.all_input_nodes:
                if arg in self.shard and self.kind.get(arg) == "seq" and not self.last:
                    self.sends[arg] = (self.shard[arg], self.segs.get(arg), "seq")  # sent as it is: 1/tp of the bytes
                elif arg in self.shard and not self.last and self._sent_as_heads(arg):
                    self.sends[arg] = (self.shard[arg], self.segs.get(arg), None)  # the next stage reads its heads
                elif arg in self.shard:
                    self._gather(node, arg)
            return
        target = node.target
        if node in self._loops:
            self._enter_loop(self._loops[node])
        if node in self.loop_dead:  # another rank's head: not run here
            return
        if node in self.loop_live:  # this rank's head: every value it reads is whole, or its head's select
            self._own_reads(node, lambda arg: (arg in self.loop_live or arg in self.shard
                                               or (node, arg) in self._claimed))
            return
        if node in self.loop_joins:
            dim, origin, _kept = self.loop_joins[node]
            self._place(node, dim, None, origin)
            return
        if target in rules.IGNORED:
            return
        if node in self.owned:  # a piece of an owned split: computed by the rank that holds it
            self._own_reads(node, lambda arg: arg in self.owned or arg in self.owned_splits)
            return
        if node in self.owned_cats:
            dim, origin = self.owned_cats[node]
            self._place(node, dim, None, origin)
            return
        if node in self.chain_steps:  # a rearranged weight or a step of one: placed where its linear claims it
            return
        if self._alias(node):
            return
        form = self._linear_form(node)
        if form is not None:
            self._linear(node, *form)
            self._use_whole(node)
            return
        if target is aten.linear.default and self._frozen_linear(node):
            self._use_whole(node)
            return
        sharded = [a for a in node.all_input_nodes if a in self.shard]
        if not sharded and node.target is operator.getitem and node.args[0] in self.items:
            sharded = [node.args[0]]  # an output of a multi-output op placed by its items (top-k's, a max's values)
        if node.name in self.local_sources and not sharded:
            self._made_on_piece(node, self.local_sources[node.name])
            return
        if node.name in self.whole_buffers and sharded:  # written in place later where a shard cannot be
            self._refuse(node, self.whole_buffers[node.name])
            self._gather_all(node)
            self._use_whole(node)
            return
        if target is aten.embedding.default and self._param(node.args[0]) is not None and not sharded:
            self._embedding(node)
            return
        if target in rules.BAGS and not sharded and self._bag_lookup(node):
            return
        found = rules.indexed_rows(node) if not sharded else None
        if found is not None and self._param(found[0]) is not None:
            self._embedding(node)  # W_E[tokens, :]: an embedding spelled as indexing, vocabulary-parallel as one
            return
        if sharded and not self._propagate(node, target, sharded):
            said = len(self.reasons)
            if self._by_torch(node, sharded):  # torch's own rule for the op (DTensor's propagator)
                if said and self.reasons[-1].startswith(f"{node.name} ("):
                    self.reasons.pop()
            else:
                if not (self.reasons and self.reasons[-1].startswith(f"{node.name} (")):
                    self._refuse(node, f"needs the whole of {', '.join(a.name for a in sharded)}")
                self._want_whole_buffer(node)
                self._gather_all(node)
        self._use_whole(node)

    def _want_whole_buffer(self, node) -> None:
        """An in-place op (``copy_`` into a slice, ``index_put_``) refused while what it writes is sharded: a gather
        would take the write into a copy and lose it. The value it writes into (through its views) is asked to be
        whole from where it is made, and the stages are walked again (:func:`_settle`)."""
        for arg in rules.written(node):
            if not (isinstance(arg, fx.Node) and arg in self.shard):
                continue
            root = rules.view_root(arg)
            if root.op != "call_function":
                raise ValueError(f"{node.name} ({node.target}){_at(node)} writes in place into {root.name}, an "
                                 f"input of the stage sharded over --tp {self.tp}: tracepp cannot keep it whole; "
                                 f"replicate the module that makes it with the model file's tp_plan")
            self.buffers_wanted[root.name] = (f"written in place by {node.name} ({node.target}){_at(node)}, which "
                                              f"cannot write a shard: kept whole")

    def _by_torch(self, node, sharded) -> bool:
        """An op the rules here do not place, placed by torch's own sharding rule for it (DTensor's propagator,
        ``split/torch_rules.py``): the output sharded as it says, or a partial sum made whole by an all-reduce; a
        whole input that carries no gradient is read at its piece. Sequence shards are not asked about; values in
        equal segments (query heads tiled to their key/value heads) only where every sharded input has the same
        ones and the op keeps the sharded dim's size, so each index is its own (a stack of head-local slices)."""
        segs = {self.segs.get(a) for a in sharded}
        segs = next(iter(segs)) if len(segs) == 1 else ()
        if self._kind_of(sharded) != "tp" or segs == () or not self.groups_of(segs) or node in self.heads_of_one:
            return False
        contraction = node.target in rules.CONTRACTIONS  # a whole operand read at its piece: its gradient joined
        on_features = all(self.shard[a] == _val(a).dim() - 1 for a in sharded)
        ruling = torch_rules.ask(node, {a: self.shard[a] for a in sharded}, self.tp,
                                 lambda arg: (contraction or not self.needs_grad.get(arg)) and self._param(arg) is None
                                 and not (on_features and self._stream_read_on(node, arg)))  # (no gradient: a frozen one)
        if ruling is None or (segs and not self._keeps_segments(node, sharded, ruling)):
            return False
        if ruling.partial and self._gathered_cheaper(node, sharded):
            return False  # its sharded operands gathered (the walk's default), the product computed whole
        for arg, dim in ruling.scatter.items():
            self.scatters.append((node, arg, dim, self.groups_of(segs)))
            self._claimed.add((node, arg))
        for arg in node.all_input_nodes:  # a whole input beside pieces: its gradient is summed over tp
            if arg not in self.shard and arg not in ruling.scatter and self.needs_grad.get(arg):
                self.copies.append((node, arg))
        origin = self._origin_of(sharded)
        if ruling.partial:
            self.sums[node] = None
            return True
        if isinstance(ruling.out, list):
            self.items[node] = [(d, segs) if d is not None else None for d in ruling.out]
            self._place(node, next(d for d in ruling.out if d is not None), segs, origin)
        else:
            self._place(node, ruling.out, segs, origin)
        return True

    def _keeps_segments(self, node, sharded, ruling) -> bool:
        """Torch's ruling for inputs in segments keeps them: no partial result, and every sharded output as wide
        on its dim as the inputs on theirs."""
        size = _val(sharded[0]).shape[self.shard[sharded[0]]]
        outs = ruling.out if isinstance(ruling.out, list) else [ruling.out]
        vals = _val(node) if isinstance(ruling.out, list) else [_val(node)]
        return not ruling.partial and all(_equal(_val(a).shape[self.shard[a]], size) for a in sharded) and all(
            d is None or (isinstance(v, torch.Tensor) and _equal(v.shape[d], size)) for d, v in zip(outs, vals))

    def _alias(self, node) -> bool:
        """A transpose of a 2-D parameter's dims or of a 3-D one's last two (``W.T`` in ``x @ W.T``, experts'
        ``bmm(x, W.transpose(1, 2))``: Inkling's shared experts): read through to the parameter."""
        if node.target not in rules.TRANSPOSES or not node.args or node.args[0] in self.aliases:
            return False
        source = node.args[0]
        if not (isinstance(source, fx.Node) and source.op == "placeholder" and source.name in self.fqn_of
                and _val(source).dim() in (2, 3)):
            return False
        ndim = _val(source).dim()
        if node.target is aten.transpose.int and sorted(d % ndim for d in node.args[1:3]) != [ndim - 2, ndim - 1]:
            return False
        if node.target is aten.permute.default and [d % ndim for d in node.args[1]] != list(range(ndim - 2)) + [
                ndim - 1, ndim - 2]:
            return False
        if node.target in (aten.t.default, aten.numpy_T.default) and ndim != 2:
            return False
        self.aliases[node] = source
        return True

    _ANY_KIND = {"item", "fresh", "write", "dtype_of"}  # families that place sequence and tp shards alike (and cat)

    def _propagate(self, node, target, sharded) -> bool:
        if any(a in self.mixed for a in sharded) and not (
                target in _MIXED_CARRIES or target in rules.SPLITS or target in rules.SLICES or target is operator.getitem):
            for arg in sharded:
                for fqn in self.origin.get(arg, ()) if arg in self.mixed else ():
                    self.unfusable.setdefault(fqn, f"its parts, some whole, are read together by {target}{_at(node)}")
            return self._refuse(node, "reads a fused projection's output with parts of both kinds")
        if (rules.family(target) not in self._ANY_KIND and target not in rules.CATS
                and self._kind_of(sharded) is None):
            return self._refuse(node, "mixes sequence shards with tensor-parallel shards")
        return self._rule(node, sharded)

    # -- each family's rule (``Propagation._rule`` finds them by ``rules.family``; moves, ops along a dim, pads and
    # triangles and reductions are the shared rules; a family not here is torch's rule, ``_by_torch``)
    def _on_item(self, node, sharded) -> bool:
        entry = (self.items.get(node.args[0]) or [])
        if node.args[0] in self.items:
            if node.args[1] >= len(entry):
                return False
            if entry[node.args[1]] is None:  # an output whole on every rank (torch's rule, a whole part)
                self._claimed.add((node, node.args[0]))
                return True
            dim, segments = entry[node.args[1]]
            parts = self.item_parts.get(node.args[0])
            if parts and parts[node.args[1]] is not None:
                self.part[node] = parts[node.args[1]]
            self._place(node, dim, segments, self.origin.get(node.args[0], frozenset()), self.kind.get(node.args[0]))
            return True
        self._carry(node, node.args[0])
        return True

    def _on_fresh(self, node, sharded) -> bool:
        """A buffer of this rank's piece (``_fresh_buffer``), or else a new tensor as whole as the sizes it names:
        ``x`` gives it only its dtype and device, so it is read at this rank's piece, not gathered (Falcon-Mamba's
        scan makes an unused ``A.new_zeros(b, d, n)`` state beside its loop, since transformers 5.25)."""
        if not self._fresh_buffer(node, node.args[0]):
            self._claimed.add((node, node.args[0]))
        return True

    def _on_write(self, node, sharded) -> bool:
        return self._fill(node)

    def _on_join(self, node, sharded) -> bool:
        if node.target in rules.STACKS:
            return self._stack(node)
        return node.target in rules.CATS and self._cat(node)

    def _stack(self, node) -> bool:
        """Parts sharded alike stacked along a new dim: each rank stacks its pieces (native-sparse-attention's three
        branches' outputs, each of this rank's heads, before their weighted sum)."""
        parts = list(node.args[0])
        if not parts or any(p not in self.shard for p in parts):
            return False
        placed = {(self.shard[p], self.segs.get(p) or (_sizes(_val(p))[self.shard[p]],), self.kind.get(p))
                  for p in parts}  # (one segment as wide as the dim is no segments)
        if len(placed) != 1:
            return False
        dim, segments, kind = next(iter(placed))
        self._place(node, rules.joined_dim(node, dim), segments if len(segments) > 1 else None,
                    self._origin_of(parts), kind)
        return True

    def _on_size(self, node, sharded) -> bool:
        """``x.size(d)`` of a value sharded on another dim: the same on every rank (the causal mask cp builds from its
        gathered keys' length, ``sym_size`` of keys sharded on their heads)."""
        x = node.args[0]
        return x in self.shard and node.args[1] % _val(x).dim() != self.shard[x]

    def _on_dtype_of(self, node, sharded) -> bool:
        if node.args[0] in self.shard:
            self._carry(node, node.args[0])
        self._claimed.add((node, node.args[1]))
        return True

    def _on_group_norm(self, node, sharded) -> bool:
        """``group_norm(x [N, C, ...], groups, weight, bias)``: a shard of the samples (dim 0) is normalised as it
        is, its weight and bias read whole; a shard of the channels in whole groups (``groups`` a multiple of tp:
        xLSTM's ``MultiHeadLayerNorm``, one group a head) is this rank's groups, normalised with its piece of the
        weight and bias (the rewrite passes ``groups / tp``). Any other shard reads across a group."""
        x, groups = node.args[0], rules.arg(node, 1, "num_groups")
        affine = [arg for arg in node.args[2:4] if isinstance(arg, fx.Node)]
        pieces = [arg for arg in affine if arg in self.shard]  # made from weights held as pieces (learned)
        if x not in sharded or set(sharded) - {x} - set(pieces) or x in self.segs and self.kind.get(x) != "seq":
            return False
        if self.shard[x] == 0 and not pieces:
            self.copies.extend((node, arg) for arg in affine if self.needs_grad.get(arg))
        elif (self.shard[x] == 1 and self.kind.get(x) != "seq" and isinstance(groups, int) and groups % self.tp == 0
              and all(self.shard[arg] == 0 and arg not in self.segs for arg in pieces)):
            for arg in affine:
                if arg in self.shard:
                    continue
                if self._param(arg) is not None:
                    self._claim(node, arg, 0)
                else:  # made from weights (xLSTM's 1 + weight): read at this rank's piece, held as one when learned
                    self.scatters.append((node, arg, 0, 1))
                    self._claimed.add((node, arg))
            self.group_norms[node] = groups // self.tp
        else:
            return False
        self._carry(node, x)
        return True

    def _on_elementwise(self, node, sharded) -> bool:
        if node.target in rules.BINARY or (len(node.all_input_nodes) > 1 and rules.is_pointwise(node.target)):
            if self._elementwise(node):
                return True
            if len(sharded) == 2 and len({self.shard[a] + _val(node).dim() - _val(a).dim() for a in sharded}) == 1:
                self._tiled_heads(*sharded)  # heads in segments beside heads in none (x-transformers' gated values
                #                              under grouped-query attention): the plain one's projection asked for them
            return False
        if node.target not in rules.UNARY or node.args[0] not in self.shard or len(sharded) != 1:
            return False
        if node.target is aten.dropout.default and node.args[1] and (len(node.args) < 3 or node.args[2]):
            return self._refuse(node, "dropout draws a different mask on each rank: keep it whole or set p=0")
        self._carry(node, node.args[0])
        return True

    _on_cast = _on_elementwise

    def _on_product(self, node, sharded) -> bool:
        return node.target in rules.MATMULS and self._batched_matmul(node)

    def _on_biased_product(self, node, sharded) -> bool:
        return self._baddbmm(node)

    def _on_einsum(self, node, sharded) -> bool:
        return self._einsum(node)

    def _on_attention(self, node, sharded) -> bool:
        return self._attention(node)

    def _on_collective(self, node, sharded) -> bool:
        """--cp's collectives along the sequence: a shard of another dim passes through (moved where ``cp_amax``
        drops the dims it reduces)."""
        first = node.args[0]
        if node.target.name() == "tracepp::cp_linear_scan":  # (a, b, dim): elementwise in a and b along the others
            return all(self.shard[x] != node.args[2] for x in sharded) and self._elementwise(node)
        if first not in self.shard or len(sharded) != 1:
            return False
        ndim, held = _val(first).dim(), self.shard[first]
        if node.target.name() == "tracepp::cp_amax":  # (x, dims, keepdim)
            dims = [d % ndim for d in node.args[1]]
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if held in dims:
                return False
            self._carry(node, first, held if keep else held - sum(1 for d in dims if d < held))
            return True
        dim = node.args[1] % ndim if len(node.args) > 1 else None
        if dim == held:
            return False
        self._carry(node, first)
        return True

    def _on_convolution(self, node, sharded) -> bool:
        return node.target in rules.CONVS and self._depthwise_conv(node)

    def _on_indexed_along(self, node, sharded) -> bool:
        return node.target is aten.gather.default and self._gather_along(node)

    def _on_cut(self, node, sharded) -> bool:
        first = node.args[0]
        if node.target in rules.TENSOR_SPLITS or first not in self.shard or len(sharded) != 1:
            return False
        return self._cut(node, node.target, first, self.shard[first], _val(first))

    def _on_index(self, node, sharded) -> bool:
        first = node.args[0]
        if first not in self.shard or len(sharded) != 1:
            return False
        return self._index(node, first, self.shard[first], _val(first), _val(node))

    def _on_repeat(self, node, sharded) -> bool:
        """Tiled: each copy a segment, holding this rank's piece of each."""
        first = node.args[0]
        if first not in self.shard or len(sharded) != 1 or self.kind.get(first) == "seq":
            return False
        dim, in_val, out_val = self.shard[first], _val(first), _val(node)
        e = dim + out_val.dim() - in_val.dim()
        times = int(node.args[1][e]) if _ints([node.args[1][e]]) else 0
        if times < 1:
            return False
        segments = tuple(self.segs.get(first) or (in_val.shape[dim],)) * times
        self._place(node, e, segments if times > 1 else self.segs.get(first), self.origin.get(first, frozenset()))
        return True

    def _on_repeat_interleave(self, node, sharded) -> bool:
        first = node.args[0]
        if first not in self.shard or len(sharded) != 1:
            return False
        if (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")) is None:
            return False  # flattened
        self._carry(node, first)  # repeating heads in place keeps each rank's block contiguous
        return True

    def _made_on_piece(self, node, dim: int) -> None:
        """An expand or ``repeat_interleave`` of a whole value's dim of 1 (Mamba-2's B and C of one group repeated to
        every head) whose value is read only at this rank's piece of ``dim``, through ops that keep each index of it
        apart (pads, views, einsums over other labels: the chunked scan's scores of each head): made on the piece
        (the rewrite makes its count this rank's), so what reads it runs on this rank's heads. The input is read as
        it is; each rank's heads give its gradient a part (``tp_copy``)."""
        self._place_on_piece(node, dim)
        self._claimed.add((node, node.args[0]))

    def _normalisable(self, x) -> bool:
        return x not in self.segs or self.kind.get(x) == "seq"  # not a fused projection's parts

    def _normalised_across(self, node) -> bool:
        return self._refuse(node, NORM_OVER_SHARD)  # gathered, or written out where cheaper (tensor_parallel.plan)

    def _read_beside(self, node, args: list) -> None:
        """Their gradients summed over tp."""
        self.copies.extend((node, arg) for arg in args if self.needs_grad.get(arg))

    def _partial_sum(self, node, target, in_val, dims) -> bool:
        """A mean or sum over the sharded dim (an RMSNorm over the whole sharded width): the local sum, summed
        over the group (``tp_all_reduce``); a mean divides by the whole count. Its result is whole."""
        kind = rules.partial_kind(node)
        if kind not in rules.SUMMED or node.kwargs.get("dtype") is not None or len(node.args) > 3:
            return self._refuse(node, f"a {target} over the sharded dim leaves each rank a partial {kind}: only a sum "
                                      f"or a mean is combined from the pieces (an all-reduce sum)")
        count = _prod([_sizes(in_val)[d] for d in dims])
        self.sums[node] = count if target is aten.mean.dim else None
        return True

    def _operands(self, node) -> list:
        return [arg for arg in node.args if isinstance(arg, fx.Node)]

    def _beside(self, node, entry, whole: list) -> bool:
        """Whole operands beside tp shards: a weight as wide as the sharded dim is sharded with it; a value without
        a gradient (a position table, a mask), or made from weights alone, or beside pieces of heads, is read at
        its piece; a broadcast one is read as it is, its gradient summed over tp (``tp_copy``)."""
        out_dim, segments = entry
        n = _val(node).dim()
        seq = self._kind_of(node.all_input_nodes) == "seq"
        broadcast, wide, cut = [], [], []
        for arg, at in whole:
            if at is None:
                broadcast.append(arg)
            elif self._param(arg) is not None and not seq and self._param(arg) not in self.forced:
                wide.append((arg, at))  # a weight as wide as the sharded dim: sharded with it
            elif self._param(arg) is not None and not seq:
                cut.append((arg, at))  # one the plan keeps whole (a tp_plan override, a trial): read at its piece
                self._use(arg, None)
            elif not seq and out_dim == n - 1 and not self.needs_grad.get(arg) and self._stream_read_on(node, arg) \
                    and not self._cell_update(node):
                return self._refuse(node, f"{arg.name} is whole and as wide as the sharded dim of "
                                          f"{', '.join(a.name for a in node.all_input_nodes if a in self.shard)}")
            elif (seq or not self.needs_grad.get(arg)) and (self.groups_of(segments) or not seq):
                cut.append((arg, at))  # a whole value beside pieces (a position table, a mask; Falcon-H1's muP
                #                        multipliers over a fused projection's parts): its piece of each part
            elif not seq and self._param_only(arg):
                cut.append((arg, at))  # made from weights alone (-exp(A_log), a bias per head): its piece
            elif not seq and self.groups_of(segments) and (
                    out_dim < n - 1 or (self._feeds_linear(node) and not self._stream_read_on(node, arg))
                    or self._cell_update(node)
                    or (n > 3 and arg.target in rules.CONTRACTIONS)):
                # one that carries a gradient, beside pieces of heads (CPM-Ant's learned position bias added to the
                # scores of each head; Mamba-2's scores of every head, an einsum [b, chunk, l, s, heads]) or gating a
                # product on its way to a linear (Gemma's per-layer inputs): its piece, the gradient pieces gathered
                # back. Not the residual stream beside a sharded output's features (added to it and read on, even
                # where a norm written out in elementwise ops leads the sum to a linear: Zamba2's shared block's
                # output projected column-wise and added to the stream, which its residual add reads again): that
                # output is better made whole (a row-wise pair)
                cut.append((arg, at))
            else:
                return self._refuse(node, f"{arg.name} is whole and as wide as the sharded dim of "
                                          f"{', '.join(a.name for a in node.all_input_nodes if a in self.shard)}")
        for arg, at in wide:
            self._claim(node, arg, at, segments)
        for arg, at in cut:
            self.scatters.append((node, arg, at, self.groups_of(segments) or tuple(segments)))
            self._claimed.add((node, arg))
        for arg in broadcast:  # each rank sees its share of the sharded dim: the gradient is summed over tp
            if self.needs_grad.get(arg):
                self.copies.append((node, arg))
        return True

    @staticmethod
    def _cell_update(node) -> bool:
        """``node`` is an op of a recurrent cell written out (``decompose.cell``: a GRU's ``(h - n) * z + n``): the
        state beside its sharded gates is read at this rank's hidden units (no row-wise pair can make the gates
        whole) and the new state gathered once, where it is read whole."""
        return decompose.of_cell(node)

    @staticmethod
    def _stream_read_on(node, arg) -> bool:
        """``node`` adds a sharded output to ``arg``, whole and read again elsewhere: the residual stream, kept whole
        (the output made whole: a row-wise pair) beside an output sharded on its features, whether or not it carries
        a gradient (before a fine-tune's adapters every layer is frozen: the stream entering them has none, and a
        whole value without one is otherwise read at its piece, as a position table is)."""
        return node.target in _SUMS and len(arg.users) > 1

    def _place_entry(self, node, entry, sources: list) -> None:
        self._place(node, entry[0], entry[1], self._origin_of(node.all_input_nodes),
                    self._kind_of(node.all_input_nodes))
