"""The context-parallel walk (``context_parallel``'s step one): one pass over one graph (a stage's, or the loss's),
in order, placing each value whole or as a sequence shard (this rank's positions of ``groups`` sequences on one dim).
The op rules it asks are ``split.rules``; this class decides what a placement means for cp: the cuts of whole values
to this rank's positions, the key/value gathers of attention, the partial sums over the sequence, the refusals with
their reasons. The rewrite is ``cp_rewrite``."""
from __future__ import annotations

import operator
import re

import sympy
import torch
import torch.fx as fx

import tracepp.runtime.context_parallel  # noqa: F401  (registers torch.ops.tracepp.cp_*)
from tracepp.split import cp_loop, rules
from tracepp.split.cost import op_name
from tracepp.split.expert_parallel import GROUPED_MM, PICKS
from tracepp.split.cp_causal import LookBack
from tracepp.split.propagation import Propagation
from tracepp.split.rules import at as _at, equal as _equal, prod as _prod_ints, sizes as _sizes_ints, val as _val

aten = torch.ops.aten
CP = torch.ops.tracepp
class ContextParallelError(ValueError):
    """A model ``--cp`` cannot spread: the message names the op, the model's source line and what would work."""


WORK = {"visits": 0}  # nodes the walks have visited (tests count the work of a plan, not its time)
_SUMMABLE = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default}  # rewritten: cp_rewrite
_MAXIMA = {aten.amax.default, aten.max.dim}  # the ranks' maxima combined (cp_amax)
_ACROSS = {aten.cumsum.default: "a cumulative sum", aten.cumprod.default: "a cumulative product",
           aten.gather.default: "a gather of positions"}  # how a refusal names an op reading across positions


def _sizes(val) -> list:
    """A value's sizes as sympy numbers and expressions (this walk divides them)."""
    return [sympy.sympify(s) for s in _sizes_ints(val)]


def _prod(items):
    return sympy.sympify(_prod_ints(items))


def _int(expr):
    """An int for a sympy integer (or a Python int), else None."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else None


class _Walk(LookBack, Propagation):
    """One pass over one graph (a stage's, or the loss's): each value's placement and the edits."""

    WORK = WORK

    def __init__(self, graph: fx.Graph, seq, cp: int, needs_grad: dict, received: dict = None,
                 expert_nodes: set = frozenset(), training: bool = True, last: bool = False, loss: bool = False,
                 fqn_of: dict = None, whole: bool = True, forced: frozenset = frozenset()):
        self.graph, self.seq, self.cp, self.needs_grad = graph, sympy.sympify(seq), cp, needs_grad
        self.whole = whole  # an op no rule places runs on the whole sequence (False: refused, --verify strict)
        self.forced = forced  # (op, line) pairs verification found placed wrong: run on the whole sequence too
        self.rewalk: set = set()  # (op, line) of values a whole op gathers that the graph writes into in place: the
        # writes would land in the gathered copy, so the plan is made again with them whole (context_parallel.plan)
        self._written = self._order = None  # the values the graph writes into; node -> position (_read_after)
        self.received = received or {}
        self.expert_nodes = expert_nodes  # nodes of routed-expert blocks: token-local
        self.training, self.last, self.loss = training, last, loss
        self.fqn_of = fqn_of or {}
        self.shard: dict = {}  # node -> (dim, groups) of its sequence shard (absent: whole)
        self.items: dict = {}  # multi-output node -> per output (dim, groups) or None
        self.cuts: list = []  # (consumer, whole input, dim, groups): cut to this rank's positions
        self.gathers: list = []  # (consumer, sharded input): all-gathered over cp (keys and values)
        self.causal: list = []  # sdpa nodes with is_causal: a mask from this rank's query positions
        self.sums: dict = {}  # node -> global count (mean) or None (sum): partial sum over the sequence
        self.maxima: dict = {}  # amax / max.dim over the sequence -> (dims, keepdim): cp_amax of the ranks' maxima
        self.halos: dict = {}  # node -> (kind, dim, reach): a causal conv1d ("conv": its input given each chunk's
        # positions before it, cp_halo), a shift along the sequence ("shift": the pad (s, -s)), a pad (reach, 0) read
        # by convolutions of that reach ("padded")
        self.unhalos: dict = {}  # node -> (dim, reach): where the outputs between the two chunks are dropped
        self.scans: dict = {}  # cumsum / cumprod / logcumsumexp along the sequence -> its dim (cp_cumsum, ...)
        self.losses: dict = {}  # loss node -> its reduction ("mean" | "sum")
        self.sizes: list = []  # sym_size nodes of a shard's sequence dim: the local size, times cp (the whole)
        self.local_factories: dict = {}  # factory node -> (dim, groups) it is made local on (expert rows, buffers)
        self.sends: dict = {}  # sharded output -> (dim, groups)
        self.outputs: list = []  # per output: (dim, groups) or None
        self.refusals: list = []
        self.dead: list = []  # values no op reads, which cp could not place: erased (cp_rewrite)
        self.whole_ops: dict = {}  # op no rule places -> why: run on the whole sequence at every cp rank
        self.whole_gathers: list = []  # (such an op, a sharded input): all-gathered over cp in sequence order
        self._loops: dict = {}  # node of a loop over positions the trace unrolled -> the loop (cp_loop.find)
        for loop in cp_loop.find(graph):
            self._loops.update(dict.fromkeys([*loop.step_of, loop.stack], loop))
        self._accepted: dict = {}  # loop -> whether each rank runs its own positions' steps
        self.position_loops: dict = {}  # such a loop's stack -> its record (cp_loop.PositionLoop.record)
        self._walk(graph)
        self._loops = self._accepted = None  # (only the records are mapped onto repeated blocks)

    # -- helpers
    def _refuse(self, node, why: str) -> bool:
        if not node.users and node.op == "call_function" and not node.is_impure() and not rules.written(node):
            self.dead.append(node)  # computed and never read (minGRU's next hidden state, out[:, -1:], when it is
            return True             # not returned): dropped from the rank's program, nothing to refuse
        self.refusals.append(f"{node.name} ({rules.op_name(node)}){_at(node)}: {why}")
        return True  # handled (the plan raises before anything is rewritten)

    def _place(self, node, dim, groups) -> None:
        self.shard[node] = (int(dim), int(groups))

    def _global(self, node, dim):
        return _sizes(_val(node))[dim]

    def _seq_dims(self, val) -> list:
        """The dims of a whole value whose size is the sequence length (candidates for a cut)."""
        if not isinstance(val, torch.Tensor):
            return []
        return [d for d, size in enumerate(_sizes(val)) if _equal(size, self.seq)]

    def _cut(self, consumer, arg, dim, groups) -> None:
        self.cuts.append((consumer, arg, dim, groups))

    def _dim(self, node) -> int:
        return self.shard[node][0]

    def _ranks(self) -> int:
        return 2 * self.cp  # chunks of each sequence

    def _entry(self, node, dim=None):
        return (self.shard[node][0] if dim is None else dim, self.shard[node][1])

    def _carry(self, node, source, dim=None) -> None:
        self._place(node, *self._entry(source, dim))

    def _across(self, node, what: str) -> bool:
        name = _ACROSS.get(node.target, f"a {rules.op_name(node)}")
        return self._refuse(node, f"{name} {what.replace('sharded dim', 'sequence dim')}: it reads positions other "
                                  f"cp ranks hold; keep it off the sequence dim, or split without --cp")

    def _partial(self, node, kind: str, dims: list) -> bool:
        """A sum or a mean over the sequence: each rank's partial sum, all-reduced (a mean divided by the whole
        count); a maximum (``amax``, the values of ``max.dim``): each rank's, all-reduced with max (``cp_amax``);
        any other partial kind (a min, a p-norm, a variance, the index of a maximum) is refused by name."""
        if node.target in _MAXIMA:
            if any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users):
                return self._refuse(node, f"the index of a {rules.op_name(node)} over the sequence dim is a position "
                                          f"among every cp rank's: only the maximum itself is combined from the "
                                          f"ranks' parts (amax)")
            self.maxima[node] = rules.reduction(node)
            return True
        if node.target not in _SUMMABLE:
            return self._refuse(node, f"a {rules.op_name(node)} over the sequence dim leaves each rank a partial "
                                      f"{kind}: only a sum or a mean is combined from the cp ranks' parts")
        count = _prod([_sizes(_val(node.args[0]))[d] for d in dims])
        self.sums[node] = count if kind == "mean" else None
        return True

    # -- the walk
    def _visit(self, node) -> None:
        if node.op == "placeholder":
            if node.name in self.received and self.received[node.name] is not None:
                self._place(node, *self.received[node.name])
            return
        if node.op == "output":
            for arg in node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]:
                placed = self.shard.get(arg) if isinstance(arg, fx.Node) else None
                if placed is not None and self.last and not self.training and not self.loss:
                    self.gathers.append((node, arg))  # forward only: the model's outputs leave whole
                    placed = None
                self.outputs.append(placed)
                if placed is not None:
                    self.sends[arg] = placed
            return
        if node.op != "call_function" or node.target in rules.IGNORED or node in self.unhalos:
            return  # (a causal convolution's cut back to the sequence: placed with the convolution)
        if node in self._loops and self._position_loop(node, self._loops[node]):
            return
        sharded = [a for a in node.all_input_nodes if a in self.shard]
        if not sharded and node.target is operator.getitem and node.args[0] in self.items:
            sharded = [node.args[0]]  # an output of a multi-output op that holds shards
        mark = self._mark()
        if self.forced and (rules.op_name(node), rules.where(node)) in self.forced:
            self._refuse(node, "its rule placed it wrong: verification found its value differed from the unsharded "
                               "graph's")
        elif not sharded:
            self._seed(node)
        elif node in self.expert_nodes and self._token_local(node, sharded):
            pass
        elif not self._rule(node, sharded):
            self._refuse(node, self._why_not(node, sharded))
        if self.whole and len(self.refusals) > mark["refusals"] and node not in self.expert_nodes:
            self._run_whole(node, mark)  # (inside a block of routed experts the token indices are the rank's own:
            # gathered, they would not index the whole sequence's tokens; such an op stays refused by name)

    def _position_loop(self, node, loop) -> bool:
        """A node of a loop over positions (``cp_loop``): each rank runs the steps of its own positions, where every
        position a step reads is of a sequence shard of one sequence on that dim, as long as the loop, and nothing
        else of a step is sharded (the state carried as ``h = a * h + b``: ``cp_linear_scan``). Its stack is then
        this rank's positions in its order; the steps' values are each rank's own (placed nowhere). False where the
        loop is not one (its ops placed one by one, or run on the whole sequence)."""
        if loop not in self._accepted:
            self._accepted[loop] = self._accept_loop(loop)
            if self._accepted[loop]:
                self.position_loops[loop.stack] = loop.record()
        if not self._accepted[loop]:
            return False
        if node is loop.stack:
            self._place(node, rules.arg(node, 1, "dim", 0) % _val(node).dim(), 1)
        return True

    def _accept_loop(self, loop) -> bool:
        """Each rank may run its own positions' steps: the loop cuts into 2 cp chunks, verification did not find it
        placed wrong, every read is of a sequence shard of one sequence on the read's dim, as long as the loop, and no
        step reads anything else that runs along the sequence (a shard, or a whole value as long as it: a step would
        read it at its position in the whole sequence, which is not the rank's local position)."""
        if loop.steps % (2 * self.cp) or any((rules.op_name(n), rules.where(n)) in self.forced
                                             for n in [*loop.step_of, loop.stack]):
            return False
        for src, dim, _step in loop.reads.values():
            if self.shard.get(src) != (dim, 1) or not _equal(self._global(src, dim), loop.steps):
                return False
        for n in loop.step_of:
            if n in loop.reads:
                continue
            for a in n.all_input_nodes:
                if a not in loop.step_of and a is not loop.start and (a in self.shard or self._seq_dims(_val(a))):
                    return False
        return loop.start is None or loop.start not in self.shard

    def _mark(self) -> dict:
        """How long every record of the walk is (each grows by appending), so a rule's partial edits can be undone."""
        return {name: len(value) for name, value in vars(self).items()
                if isinstance(value, (list, dict)) and not name.startswith("_")}

    def _run_whole(self, node, mark: dict) -> None:
        """An op no rule places (its refusal just recorded) run on the whole sequence at every cp rank instead:
        what its rule had recorded undone, each sharded input all-gathered over cp in sequence order (the gather's
        backward reduce-scatters, so the ranks' gradients stay the whole's), its outputs whole. A whole value
        meeting a shard later is cut to this rank's positions there (``_beside``), as a rotary table is. Exact,
        at the cost of the gather and of computing the op (and what follows it until the cut) cp times."""
        why = re.split(r"; |\. (?=[A-Z])", self.refusals[mark["refusals"]].split(": ", 1)[-1])[0]  # (not the advice)
        for name, length in mark.items():
            value = getattr(self, name)
            if isinstance(value, list):
                del value[length:]
            else:
                for key in list(value)[length:]:
                    del value[key]
        self.whole_ops[node] = why
        for arg in dict.fromkeys(node.all_input_nodes):
            if arg in self.shard and not (arg.op == "placeholder" and arg.name not in self.received):
                self.whole_gathers.append((node, arg))  # (a floating input cut at its first use is read whole)
                root = rules.view_root(arg)
                if root.op == "call_function" and self._read_after(root, node):
                    self.rewalk.add((rules.op_name(root), rules.where(root)))  # RWKV's output[:, i] = ... of its
                    # zeros_like(key), read whole after the loop: made whole from the start

    def _read_after(self, root, node) -> bool:
        """``root`` is written in place and read after ``node`` (an op run on the whole sequence, reading a gathered
        copy of it) other than through ``node``: by an op that is not a view, on it or on any view of it. Writes made
        through ``node``'s output land in the copy, and such a read would miss them."""
        if self._written is None:  # (made when an op first runs whole: most walks never ask)
            self._written = rules.written_roots(self.graph)
            self._order = {n: i for i, n in enumerate(self.graph.nodes)}
        if root not in self._written:
            return False
        order = self._order
        todo, seen = [root], set()
        while todo:
            value = todo.pop()
            for user in value.users:
                if user is node or user in seen:
                    continue
                seen.add(user)
                if rules.is_view(user) and user.args[0] is value:
                    todo.append(user)
                elif order.get(user, -1) > order[node] and value not in rules.written(user):
                    return True
        return False

    def _why_not(self, node, sharded) -> str:
        held = ", ".join(f"{a.name} (positions on dim {self.shard[a][0]})" for a in sharded)
        namespace = getattr(node.target, "namespace", "aten")
        if namespace not in ("aten", "prims", "tracepp"):  # a custom op: what it computes is its own code's
            return (f"{namespace}::{rules.op_name(node)} is a custom op (torch.library) that reads sequence shards "
                    f"({held}): context parallelism has no rule for what it computes across positions; write it "
                    f"with torch ops (or give it a composite implementation), or split without --cp")
        return (f"mixes the positions of the sequence in a way context parallelism cannot split ({held} are "
                f"sequence shards): only attention may read other ranks' positions; keep this op off the "
                f"sequence dim, or split without --cp")

    def _seed(self, node) -> None:
        """Where the shards begin: an embedding of whole token ids with the sequence dim, or a floating batched
        input with it read by an op that carries a gradient."""
        target = node.target
        ids = node.args[1] if target is aten.embedding.default else self._table_rows(node)
        if ids is not None:
            dims = self._seq_dims(_val(ids))
            if dims and not self.loss:  # token ids (or positions: their lookup is cut the same way)
                self._cut(node, ids, dims[0], 1)
                self._place(node, dims[0], 1)
            return
        if self.loss or not self.needs_grad.get(node):
            return
        for arg in node.all_input_nodes:
            val = _val(arg)
            if (arg.op == "placeholder" and arg.name not in self.fqn_of and isinstance(val, torch.Tensor)
                    and val.dtype.is_floating_point and self._seq_dims(val)):
                dim = self._seq_dims(val)[0]
                self._cut(node, arg, dim, 1)
                self.shard[arg] = (dim, 1)  # read as a shard from here on (the cut is inserted before its uses)
                if not self._rule(node, [arg]):
                    self._refuse(node, self._why_not(node, [arg]))
                return

    def _table_rows(self, node):
        """The token ids a whole table is indexed by, ``W_E[tokens, :]`` (``rules.indexed_rows``): a parameter, or
        one made from it on every call (nGPT's ``F.normalize(weight)[ids]`` through its parametrization); else
        None."""
        found = rules.indexed_rows(node)
        return found[1] if found is not None and found[0] not in self.shard and (
            found[0].name in self.fqn_of or self.needs_grad.get(found[0])) else None

    # -- each family's rule (``Propagation._rule`` finds them by ``rules.family``)
    def _on_item(self, node, sharded) -> bool:
        entry = self.items.get(node.args[0])
        if entry is None:
            if node.args[0] in self.shard:
                self._place(node, *self.shard[node.args[0]])
                return True
            return False
        placed = entry[node.args[1]] if node.args[1] < len(entry) else None
        if placed is not None:
            self._place(node, *placed)
        return True

    def _on_size(self, node, sharded) -> bool:
        dim = node.args[1] % _val(node.args[0]).dim()
        if self.shard[node.args[0]][0] == dim:
            self.sizes.append(node)
        return True

    def _on_cast(self, node, sharded) -> bool:
        first = node.args[0]
        if first not in self.shard or len(sharded) != 1:
            return False
        self._place(node, *self.shard[first])
        return True

    _on_like = _on_cast

    def _on_dtype_of(self, node, sharded) -> bool:
        first = node.args[0]
        if first in self.shard:
            self._place(node, *self.shard[first])
        return True  # a whole value cast to a shard's dtype (OLMo-core's weight.type_as(x)): whole

    def _on_product(self, node, sharded) -> bool:
        return self._matmul(node, sharded)

    def _on_write(self, node, sharded) -> bool:
        return self._elementwise(node)

    def _on_repeat_interleave(self, node, sharded) -> bool:
        dim = rules.arg(node, 2, "dim")
        first = node.args[0]
        if dim is None or first not in self.shard or dim % _val(first).dim() == self.shard[first][0]:
            return False
        self._place(node, *self.shard[first])
        return True

    def _on_repeat(self, node, sharded) -> bool:
        """Along the sequence dim, k copies of its sequences side by side (Llama 4's tokens repeated once per
        expert): k times the groups."""
        first = node.args[0]
        repeats = list(node.args[1])
        d, groups = self.shard[first]
        at = d + len(repeats) - _val(first).dim()
        if not isinstance(repeats[at], int) or repeats[at] < 1:
            return False
        self._place(node, at, groups * repeats[at])
        return True

    def _on_view_as(self, node, sharded) -> bool:
        """The shape of another shard, placed alike."""
        first, other = node.args[:2]
        placed = self._view_dim(_val(first), _val(node), *self.shard[first]) if first in self.shard else None
        if placed is None or self.shard.get(other) != placed:
            return False
        self._place(node, *placed)
        return True

    def _on_linear(self, node, sharded) -> bool:
        x = node.args[0] if node.target is aten.linear.default else node.args[1]
        if sharded != [x] or self.shard[x][0] == _val(x).dim() - 1:
            return False
        self._place(node, *self.shard[x])
        return True

    def _on_lookup(self, node, sharded) -> bool:
        ids = node.args[1]
        if sharded != [ids]:
            return False
        self._place(node, *self.shard[ids])
        return True

    def _on_indexed_along(self, node, sharded) -> bool:
        return self._along(node)

    def _on_cell(self, node, sharded) -> bool:
        """A recurrent cell over rows (``gru_cell(input, hx, ...)``): each row's state its own, so rows sharded
        alike (the positions folded into them) stay so."""
        x, hx = node.args[0], node.args[1]
        if sharded != [x, hx] or self.shard[x] != self.shard[hx] or self.shard[x][0] != 0:
            return False
        self._place(node, *self.shard[x])
        return True

    def _on_bag(self, node, sharded) -> bool:
        """``embedding_bag`` of 2-D indices (each row one bag; product-key memory's ``values(indices,
        per_sample_weights=attn)``): rows of indices and weights sharded alike (the positions folded into them) give
        the rows of the bags' sums, the table read whole."""
        weight, indices = node.args[0], node.args[1]
        offsets, weights = rules.named(node, "offsets"), rules.named(node, "per_sample_weights")
        rows = [a for a in (indices, weights) if isinstance(a, fx.Node)]
        if (weight in sharded or set(sharded) != set(rows) or len({self.shard[a] for a in rows}) != 1
                or self.shard[indices][0] != 0):
            return False
        if offsets is not None:  # 1-D indices in bags of k (nn.EmbeddingBag's 2-D input, flattened by
            if not self._equal_bags(offsets, indices):  # F.embedding_bag with arange(0, numel, k) offsets)
                return False
            self.local_factories[offsets] = self.shard[indices]  # this rank's bags: arange(0, its numel, k)
            self._place(offsets, *self.shard[indices])
        elif _val(indices).dim() != 2:
            return False
        self.items[node] = [self.shard[indices]] + [None] * (len(_val(node)) - 1)
        return True

    def _equal_bags(self, offsets, indices) -> bool:
        """``offsets`` is ``arange(0, numel, k)`` of ``indices`` (1-D, sharded), whole and read by this bag alone:
        every bag k indices, so that this rank's indices are whole bags of its positions."""
        if not (isinstance(offsets, fx.Node) and offsets.target is aten.arange.start_step and offsets not in self.shard
                and len(offsets.users) == 1 and _val(indices).dim() == 1):
            return False
        start, end, step = (list(offsets.args) + [None] * 3)[:3]
        numel = self._global(indices, 0)
        return start == 0 and isinstance(step, int) and _equal(end, numel) and rules.ints([numel]) and int(
            numel) % (step * self.cp * self.shard[indices][1]) == 0

    def _on_convolution(self, node, sharded) -> bool:
        x = node.args[0]
        if sharded == [x] and self.shard[x][0] >= 2 and rules.pointwise_convolution(node):
            self._place(node, *self.shard[x])  # a 1 x 1 kernel: channels mixed at each position on its own
            return True
        if sharded == [x] and self._causal(node):
            return True
        if node.args[0] in self.shard and self.shard[node.args[0]][0] >= 2:
            return self._refuse(node, "a convolution along the sequence dim that is not causal as written: each "
                                      "position would read positions other cp ranks hold. A causal conv1d, "
                                      "conv1d(padding=reach) cut back with [..., :seqlen] or [..., :-reach], or "
                                      "unpadded after F.pad(x, (reach, 0)), gets the positions before each chunk "
                                      "from the rank that holds them; write it so, keep it off the sequence, or "
                                      "split without --cp")
        return False

    def _on_fresh(self, node, sharded=None) -> bool:
        """``x.new_empty(sizes)`` of a shard, as long as the shard along its dim (a buffer the model fills with
        the shard's values: DeepSeek-V3's keys): made for this rank's positions."""
        x, sizes = node.args[0], list(node.args[1])
        dim, groups = self.shard[x]
        if len(sizes) != _val(x).dim() or not _equal(_sizes(_val(node))[dim], self._global(x, dim)):
            return False
        self.local_factories[node] = (dim, groups)
        self._place(node, dim, groups)
        return True

    # -- the rules
    def _beside(self, node, entry, whole: list) -> bool:
        """Whole operands beside sequence shards: one with the sequence (a rotary table, a mask's rows) is cut to
        this rank's positions; one broadcast along it is read as it is. A write into a whole value is refused."""
        for arg, at in whole:
            if at is None:
                continue
            if arg in rules.written(node):
                return self._refuse(node, f"writes this rank's positions into {arg.name}, which is whole: the "
                                          f"write would land in a copy; make the buffer from the sharded value "
                                          f"(x.new_empty, torch.empty_like)")
            self._cut(node, arg, at, entry[1])
        return True

    def _place_entry(self, node, entry, sources: list) -> None:
        self._place(node, *entry)

    def _view_dim(self, in_val, out_val, dim, groups):
        """The output dim (and its sequences) of a shard through a view, or None: ``rules.view_blocks`` with the
        rank's positions of each sequence kept in one output dim (kept, merged with the batch before it or the
        features after it, or split back)."""
        return rules.view_blocks(_sizes(in_val), _sizes(out_val), dim, groups, self.cp, whole=self.seq / self.cp)

    def _on_view(self, node, sharded) -> bool:
        first = node.args[0]
        if sharded != [first]:
            return False
        placed = self._view_dim(_val(first), _val(node), *self.shard[first])
        if placed is None:
            return self._refuse(node, f"reshapes the sequence dim of {first.name} ({list(_val(first).shape)} -> "
                                      f"{list(_val(node).shape)}) so that positions would not stay whole in one "
                                      f"dim: context parallelism cannot cut it")
        self._place(node, *placed)
        return True

    def _local_size(self, sizes, dim: int, size) -> bool:
        return True  # every view's and expand's sizes along the sequence are made local (cp_rewrite)

    def _on_cut(self, node, sharded) -> bool:
        first = node.args[0]
        if sharded != [first]:
            return False
        dim, groups = self.shard[first]
        target = node.target
        at = rules.cut_dim(node)
        if at == dim:
            start, length = rules.arg(node, 2, "start"), _int(self._global(first, dim))
            if target is aten.slice.Tensor and rules.arg(node, 4, "step", 1) == 1 and (start in (None, 0) or (
                    isinstance(start, int) and length is not None and start <= -length)):  # minGRU's [:, -seq_len:]
                end = rules.arg(node, 3, "end")
                if end is None or (isinstance(end, int) and length is not None and end >= length):
                    self._place(node, dim, groups)  # the whole dim: nothing taken
                    return True
            return self._refuse(node, f"takes part of the sequence dim of {first.name}: positions held by other "
                                      f"cp ranks; shift or trim sequences in the batch (batch(step), the target), "
                                      f"not inside the model")
        out_dim = rules.kept_dim(node, dim)
        if target in rules.CUTS:
            out = _val(node)
            self.items[node] = [(out_dim, groups)] * (len(out) if isinstance(out, (list, tuple)) else 0)
            return True
        self._place(node, out_dim, groups)
        return True

    def _on_join(self, node, sharded) -> bool:
        parts = [p for p in node.args[0] if not rules.skipped_by_cat(p)]
        placed = {self.shard[p] for p in parts if p in self.shard}
        if len(placed) != 1:
            return False
        dim, groups = next(iter(placed))
        if len(parts) == 1 and node.target in rules.CATS:  # one part beside empty ones (a cache that starts empty)
            self._place(node, dim, groups)
            return True
        out_dim = rules.joined_dim(node, dim)
        if out_dim is None:
            return self._refuse(node, "joins values along the sequence dim (a prefix or another sequence): "
                                      "positions would move between cp ranks")
        for part in parts:
            if part not in self.shard:
                if not _equal(_sizes(_val(part))[dim], self._global(next(p for p in parts if p in self.shard),
                                                                      dim)):
                    return False
                self._cut(node, part, dim, groups)
        self._place(node, out_dim, groups)
        return True

    def _normalised_across(self, node) -> bool:
        return self._refuse(node, "normalises over the sequence dim")

    def _on_group_norm(self, node, sharded) -> bool:
        """``group_norm`` of positions merged into its samples (dim 0, xLSTM's ``[B * S, heads * d]``): each
        position normalised as it is; over a dim it normalises, refused."""
        x = node.args[0]
        if sharded != [x]:
            return False
        if self.shard[x][0] != 0:
            return self._refuse(node, "normalises over the sequence dim")
        self._place(node, *self.shard[x])
        return True

    def _on_index(self, node, sharded) -> bool:
        """``x[idx, ...]``: a whole table read at sharded positions (``cos[position_ids]``), or a shard indexed
        on its other dims."""
        x, indices = node.args[0], list(node.args[1])
        out_val, in_val = _val(node), _val(x)
        used = [k for k, i in enumerate(indices) if i is not None]
        if x in self.shard:
            dim, groups = self.shard[x]
            e = rules.indexed_dim(node, dim)
            if e is None or any(isinstance(i, fx.Node) and i in self.shard for i in indices):
                return self._refuse(node, "a gather of positions of the sequence (indexing the sequence dim): "
                                          "positions held by other cp ranks")
            if not (0 <= e < out_val.dim()) or not _equal(_sizes(out_val)[e], _sizes(in_val)[dim]):
                return False
            self._place(node, e, groups)
            return True
        # a whole table, sharded index tensors: the output's advanced-index dims are their broadcast
        adjacent = used == list(range(used[0], used[-1] + 1))
        start = used[0] if adjacent else 0
        width = max(_val(i).dim() for i in indices if i is not None)
        placed = None
        for i in indices:
            if isinstance(i, fx.Node) and i in self.shard:
                d, groups = self.shard[i]
                e = start + d + width - _val(i).dim()
                if placed is not None and placed != (e, groups):
                    return False
                placed = (e, groups)
        e, groups = placed
        for i in indices:
            if isinstance(i, fx.Node) and i not in self.shard:
                at = e - start - (width - _val(i).dim())
                if at >= 0 and not _equal(_val(i).shape[at], 1):
                    self._cut(node, i, at, groups)
        self._place(node, e, groups)
        return True

    def _matmul(self, node, sharded, a=None, b=None) -> bool:
        """``a @ b``: a shard on a batch dim or on ``a``'s rows is carried; attention's scores (``a``'s rows and
        ``b``'s columns both positions) and ``probs @ v`` (``b``'s rows positions, ``a``'s columns whole) gather
        ``b`` over cp; both operands sharded on the contracted dim give a partial sum. ``a``, ``b``: the operands
        where they are not the node's first two arguments."""
        if a is None:
            a, b = node.args[:2]
        out_val = _val(node)
        n = out_val.dim()
        va, vb = _val(a), _val(b)
        if vb.dim() == 1 and va.dim() > 1 and b not in self.shard and a in self.shard:
            # x @ w with a vector w (hyper-connections' normed @ dynamic_beta_fn): each position's features dotted
            # with w, the shard carried where it is not on the features
            dim, groups = self.shard[a]
            if dim == va.dim() - 1:
                return False
            self._place(node, dim, groups)
            return True
        if vb.dim() == 1 or va.dim() == 1:
            return False
        sa, sb = self.shard.get(a), self.shard.get(b)
        rows_a = sa is not None and sa[0] == va.dim() - 2
        cols_a = sa is not None and sa[0] == va.dim() - 1
        rows_b = sb is not None and sb[0] == vb.dim() - 2
        cols_b = sb is not None and sb[0] == vb.dim() - 1
        batch_a = sa is not None and sa[0] < va.dim() - 2
        batch_b = sb is not None and sb[0] < vb.dim() - 2
        if batch_a or batch_b:
            placed = None
            for arg, s, val in ((a, sa, va), (b, sb, vb)):
                if s is not None:
                    e = s[0] + n - val.dim()
                    if s[0] >= val.dim() - 2 or (placed is not None and placed != (e, s[1])):
                        return False
                    placed = (e, s[1])
            e, groups = placed
            for arg, s, val in ((a, sa, va), (b, sb, vb)):
                if s is None:
                    at = rules.aligned_dim(n, e, val)
                    if at is not None:
                        self._cut(node, arg, at, groups)
            self._place(node, e, groups)
            return True
        if cols_a and rows_b:  # a sum over positions (k.T @ v): partial sums, summed over cp
            self.sums[node] = None
            return True
        if cols_a:
            return False
        if rows_a:
            if cols_b or rows_b:  # q @ k.T (scores) or probs @ v: the other operand's positions gathered
                self.gathers.append((node, b))
            self._place(node, n - 2, sa[1])
            return True
        if sa is None and cols_b:  # W @ x.T: the columns stay positions
            self._place(node, n - 1, sb[1])
            return True
        if sa is None and rows_b:  # a whole a read against the positions of b: a sum over positions
            self._cut(node, a, va.dim() - 1, sb[1])
            self.sums[node] = None
            return True
        return False

    def _on_einsum(self, node, sharded=None) -> bool:
        """``einsum(equation, operands)``, each sharded operand holding positions on one label: the first whose
        label the output keeps sets the output's placement (the queries of ``b h i d, b h j d -> b h i j``, the
        scores' rows of ``b h i j, b h j d -> b h i d``: x-transformers', PaLM's and einops' attention); one sharded
        on another label (the keys, the values) is gathered over cp; a whole operand with the label is cut to this
        rank's positions (a mask or a bias per query). Where every sharded operand's label is summed over, a label
        they share (``b n d, b n e -> b d e``), each rank holds a partial sum, summed over cp."""
        labels, operands = rules.einsum_labels(node), list(node.args[1])
        if labels is None:
            return False
        specs, output = labels
        label_of = {arg: spec[self.shard[arg][0]] for spec, arg in zip(specs, operands) if arg in self.shard}
        anchor = next((arg for arg in operands if arg in label_of and label_of[arg] in output), None)
        summed = anchor is None
        if summed:
            anchor = next(arg for arg in operands if arg in label_of)
            if len({label_of[a] for a in label_of}) != 1:
                return False
        label, (dim, groups) = label_of[anchor], self.shard[anchor]
        if any(spec.count(label) > 1 for spec in specs) or output.count(label) > 1:
            return False  # a diagonal of positions
        for spec, arg in zip(specs, operands):
            if arg in label_of:
                if label_of[arg] != label:
                    self.gathers.append((node, arg))  # the keys of the scores, the values: every position
                elif self.shard[arg][1] != groups:
                    return False
                continue
            at = spec.find(label)
            if at >= 0 and not _equal(_val(arg).shape[at], 1):
                if not _equal(_sizes(_val(arg))[at], self._global(anchor, dim)):
                    return False
                self._cut(node, arg, at, groups)
        if summed:
            self.sums[node] = None
        else:
            self._place(node, output.index(label), groups)
        return True

    def _on_biased_product(self, node, sharded=None) -> bool:
        """``baddbmm(bias, a, b)``: ``a @ b`` placed as a matmul (BLOOM's attention scores, ``q @ k^T`` over heads
        merged with the batch: the keys gathered), and the bias added to its result as a pointwise operand: read at
        this rank's positions where it has a sequence dim (cut to the query rows), whole where it is per key (ALiBi's
        ``[b * heads, 1, keys]``, against the gathered keys). A product summed over positions is refused: each
        rank's part would add the bias."""
        bias, a, b = node.args[:3]
        if not self._matmul(node, [x for x in (a, b) if x in self.shard], a, b) or node not in self.shard:
            return False
        e, groups = self.shard[node]
        val = _val(bias)
        at = e - (_val(node).dim() - val.dim())
        if bias in self.shard:
            return self.shard[bias] == (at, groups)
        if at >= 0 and not _equal(val.shape[at], 1):
            if not _equal(_sizes(val)[at], self._global(node, e)):
                return False
            self._cut(node, bias, at, groups)
        return True

    def _on_attention(self, node, sharded) -> bool:
        q, k, v = node.args[:3]
        mask = rules.arg(node, 3, "attn_mask")
        if q not in self.shard or self.shard[q][0] != _val(q).dim() - 2:
            return False
        groups = self.shard[q][1]
        for kv in (k, v):
            if kv in self.shard:
                if self.shard[kv][0] != _val(kv).dim() - 2:
                    return False
                self.gathers.append((node, kv))
            elif not _equal(_sizes(_val(kv))[-2], self.seq):
                if rules.arg(node, 5, "is_causal", False):
                    return False
                # keys of no position (litgpt's LLaMA-Adapter prompt, learned tokens every query attends to):
                # whole on every rank, each rank's queries reading all of them; their gradient's parts summed
                # with every parameter's over dp x cp

        if isinstance(mask, fx.Node):
            mval = _val(mask)
            if mask in self.shard:
                if self.shard[mask][0] != mval.dim() - 2:
                    return self._refuse(node, "the mask's key dim holds only this rank's positions")
            elif not _equal(mval.shape[-2], 1):
                if not _equal(_sizes(mval)[-2], self.seq):
                    return False
                if mask.op == "placeholder" and mask.name not in self.received:
                    return self._refuse(node, f"the attention mask {mask.name} is an input of the model "
                                              f"({list(mval.shape)}): a [batch, 1, seq, seq] mask given by the "
                                              f"caller is not cut for context parallelism; pass a [batch, seq] "
                                              f"padding mask (the model builds the 4-D mask inside forward, which "
                                              f"is cut to this rank's query rows), or use is_causal")
                self._cut(node, mask, mval.dim() - 2, groups)
        if rules.arg(node, 5, "is_causal", False):
            self.causal.append(node)
        self._place(node, _val(node).dim() - 2, groups)
        return True

    def _on_loss(self, node, sharded) -> bool:
        """A loss over sharded tokens: per-token (reduction none) carries the shard; a mean becomes a sum and a
        count, a sum a partial sum, both summed over cp."""
        weight_at, reduction_at = rules.LOSSES[node.target]
        first, target = node.args[0], node.args[1]
        if first not in self.shard:
            return False
        dim, groups = self.shard[first]
        ndim = _val(first).dim()
        classes = node.target in rules.IGNORE_INDEX
        if classes and (dim == 1 and ndim > 1):
            return self._refuse(node, "the class dim of the loss is the sequence dim")
        if isinstance(target, fx.Node):
            tval = _val(target)
            t_dim = dim - (1 if classes and dim > 1 else 0) if classes else dim
            if target in self.shard:
                if self.shard[target] != (t_dim, groups):
                    return False
            else:
                if not _equal(_sizes(tval)[t_dim], self._global(first, dim)):
                    return False
                self._cut(node, target, t_dim, groups)
        if weight_at is not None and isinstance(rules.arg(node, weight_at, "weight"), fx.Node) and \
                rules.arg(node, weight_at, "weight") in self.shard:
            return False
        reduction = rules.arg(node, reduction_at, "reduction", 1)
        if reduction == 0:
            self._place(node, dim - (1 if classes and dim > 1 else 0) if classes else dim, groups)
            return True
        self.losses[node] = "mean" if reduction == 1 else "sum"
        return True

    def _token_local(self, node, sharded) -> bool:
        """Inside a block of routed experts every token is computed on its own: this rank sorts, counts and
        gathers its own tokens. True where handled (the op's output placed as its tokens' shard, or whole)."""
        target = node.target
        out_val = _val(node)
        first = node.args[0] if node.args else None
        picks = target in PICKS and len(node.args) == 1 and first in self.shard and self._dim(first) == 0
        if picks or target in (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
                               aten.topk.default):  # picks: a mask's true entries over this rank's tokens (their rows)
            if isinstance(out_val, (list, tuple)):
                self.items[node] = [self.shard[first]] * len(out_val)
            else:
                self._place(node, *self.shard[first])
            return True
        if target in (aten.histc.default, aten.bincount.default):
            return True  # this rank's counts per expert (the offsets of its own rows): whole-shaped
        if op_name(node) in GROUPED_MM:  # this rank's rows, grouped by expert with its own offsets
            rows = node.args[0]
            if rows not in self.shard:
                return False
            self._place(node, *self.shard[rows])
            return True
        if target is aten.index.Tensor:
            x, indices = node.args[0], list(node.args[1])
            for i in indices:
                if isinstance(i, fx.Node) and i in self.shard:
                    self._place(node, *self.shard[i])
                    return True
            return False
        if target in (aten.index_put_.default, aten.index_put.default):
            x, indices, values = node.args[:3]
            if x in self.shard:
                if isinstance(values, fx.Node) and values not in self.shard:
                    self._local_factory(values, x)
                self._place(node, *self.shard[x])
                return True
            return False
        return False

    def _local_factory(self, node, like) -> None:
        """A factory value (``arange`` of the rows) in an expert block, as long as a shard's dim: made local."""
        if node.op == "call_function" and node.target in rules.FACTORIES:
            self.local_factories[node] = self.shard[like]
            self._place(node, *self.shard[like])
