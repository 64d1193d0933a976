"""Tensor parallelism read from the traced graph: which parameters each stage shards over ``--tp`` ranks, and
the stage graphs rewritten to run on the shards.

The plan is Megatron's, found rather than written by hand. Every value of a stage graph gets a placement: whole
(every tp rank holds all of it) or sharded on one dim (rank r holds the r-th of ``tp`` equal contiguous pieces
of each *segment* of that dim; most values have one segment, a fused projection's output has one per part).
Walking the graph in order:

* a linear whose weight is a 2-D parameter and whose input is whole becomes **column-wise** (weight and bias
  split on the output features); its input passes through ``tp_copy`` (identity forward, all-reduce of the
  gradient backward) and its output is sharded on the last dim. A linear is any of the spellings export keeps:
  ``linear(x, W, b)``, GPT-2's Conv1D ``addmm(b, x, W)`` / ``mm`` / ``matmul(x, W)`` with ``W`` stored
  ``[in, out]``, and ``matmul(x, W.T)`` (Falcon's ``FalconLinear``);
* a fused projection (``qkv``, ``gate_up``) whose output is cut on its features by ``split``, ``chunk`` or
  slices becomes column-wise with one segment per part: each rank holds the rows of its own heads in every part
  (its q, k and v rows; its gate and up rows), and the cuts take the local parts (``_segments_needed``);
* ops that keep a sharded dim apart (elementwise ops and casts, views that split it into heads or merge heads
  back, at every batch size, transposes, attention over the head dim, reductions over other dims, slices,
  indexing and concatenations of other dims, ``repeat_interleave`` of heads) carry the sharding through; a
  whole operand broadcast along the sharded dim (rotary tables, a per-head-dim norm weight, a per-token gate) is
  read as it is, and one that carries a gradient (by the graph's flow from the parameters, not export's
  metadata) goes through ``tp_copy`` so its gradient is summed; a parameter as wide as the sharded dim (the
  weight of a norm over the whole projection, OLMo2's q/k norms) is sharded with it;
* a mean or sum over the sharded dim (an RMSNorm over the whole sharded width) is computed from the partial
  sums: the local sum, ``tp_all_reduce``, divided by the whole count for a mean;
* a linear whose input is sharded on its last dim becomes **row-wise** (weight split on the input features):
  its partial product goes through ``tp_all_reduce`` and then takes the bias;
* an embedding whose weight is a parameter becomes **vocabulary-parallel** (``Shard(0)``);
* anything else that meets a sharded value gets it whole through ``tp_all_gather`` (the head's logits before
  the loss), and so do the stage's outputs: every value that crosses a stage boundary is replicated.

A column-wise linear whose output only ever gets gathered is kept only when it leaves the stage (the head's
vocabulary rows) or it is a recurrent cell's, written out, that computes at least twice the elements it gathers (a
GRU gate's two linears of three gates, gathered once as the new state); otherwise it is replicated. A parameter
must take one placement everywhere it is used (a tied
embedding and head, on one stage or two): where its uses disagree it is replicated. So is any dim that
``tp`` does not divide (grouped-query attention with fewer key/value heads than ``tp`` replicates its
attention), and whatever the model file's ``tp_plan`` (FQN pattern -> ``"replicate"``) names. Every
replication carries its reason: the op and the model's source line. Mixture-of-experts weights (grouped
matmuls) are replicated over tp: experts shard over ``--ep``.

The result, :class:`TPPlan`, is plain data for the manifest; :func:`apply` rewrites the stage graphs.
"""
from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from tracepp.split import decompose, plan_cost, rules, tp_grads, tp_settle
from tracepp.split.cost import held_bytes
from tracepp.split.partition import _gradient_flags
from tracepp.split.rules import sizes as _sizes, val as _val
from tracepp.split.tp_rewrite import apply  # noqa: F401  (step three: the driver calls tensor_parallel.apply)
from tracepp.split.tp_settle import (_forced_by_overrides, _over_budget, _param_roles, fqn_map,  # noqa: F401
                                     grad_flags, settle, within_budget)
from tracepp.split.tp_walk import NORM_OVER_SHARD, WORK, _Walk  # noqa: F401  (tests count the walks' work here)

aten = torch.ops.aten


@dataclass
class TPPlan:
    """Plain data: the tensor-parallel degree, each parameter's placement and the collectives per stage."""

    size: int
    params: dict = field(default_factory=dict)  # fqn -> {"dim", "role", "segments"?, "why"?}
    stages: list = field(default_factory=list)  # per stage: {"collectives", "replicated", "share"}
    sequence_parallel: dict = None  # with --sequence-parallel: the sequence length and the values sent sharded
    sent: dict = field(default_factory=dict)  # value name -> the dim it crosses a stage boundary sharded on

    def to_json(self) -> dict:
        out = {"size": self.size, "params": self.params, "stages": self.stages}
        if self.sent:
            out["sent"] = self.sent
        if self.sequence_parallel is not None:
            out["sequence_parallel"] = self.sequence_parallel
        return out


def sequence_input(graph) -> list:
    """The placeholders, one per stage that reads it, of the input the sequence length is read from: the first
    batched root input of two or more dims that a stage reads (the token ids); [] where there is none."""
    for name, ref in graph.root_inputs.items():
        if not (ref.batched and ref.meta is not None and len(ref.meta.shape) >= 2):
            continue
        nodes = []
        for stage in graph.stages:  # a stage's placeholders: its state, then its root inputs in stage.root_inputs'
            placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]  # order (named anew: a root
            node = dict(zip(stage.root_inputs, placeholders[len(stage.state):])).get(name)  # `input` is `input_1`)
            if node is not None:
                nodes.append(node)
        if nodes:
            return nodes
    return []


def sequence_length(graph):
    """The traced sequence length (an int or a sympy expression): dim 1 of :func:`sequence_input` (the token ids),
    dim 0 where the model file declares ``batch_dim = 1`` (``[seq, batch]``), or None."""
    nodes = sequence_input(graph)
    return _sizes(_val(nodes[0]))[1 - getattr(graph, "batch_dim", 0)] if nodes else None


def _boundary(stage, graph) -> dict:
    nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
    first = len(stage.state) + len(stage.root_inputs)
    return {"outputs": list(stage.outputs), "last": stage.index == graph.num_stages - 1,
            "received": {nodes[first + i].name: name for i, (_producer, name) in enumerate(stage.received)}}


def plan(graph, tp: int, overrides=None, sequence_parallel: bool = False) -> tuple:
    """(TPPlan, the final walk per stage) for ``--tp tp`` (and ``--sequence-parallel``): iterate until every
    parameter has one placement."""
    from tracepp.split.cost import node_flops

    aliases = {ref.fqn: ref.aliases for ref in graph.state.values()}
    sequence = sequence_length(graph) if sequence_parallel else None
    cp = (getattr(graph, "context_parallel", None) or {}).get("size", 1)
    if sequence is not None and cp > 1:  # context parallel holds 1/cp of the sequence: sp splits that further
        from torch.utils._sympy.functions import FloorDiv
        sequence = sympy.Integer(int(sequence) // cp) if sympy.sympify(sequence).is_Integer else FloorDiv(sequence, cp)
    if sequence_parallel:
        _check_sequence(sequence, tp)
    for stage in graph.stages:  # a recurrent cell's linears and gates placed as any others
        if decompose.cells(stage.graph):
            stage.graph.lint()

    whole: dict = {}  # the linears a last trial computes whole on every rank (fqn -> why)

    def settled() -> tuple:
        notes, mixed, gathered = dict(_forced_by_overrides(aliases, overrides), **whole), {}, {}
        found = settle([(stage.graph, fqn_map(stage, graph), grad_flags(stage, graph), _boundary(stage, graph))
                        for stage in graph.stages], tp, notes, sequence=sequence, mixed=mixed, gathered=gathered,
                       begins=segment_begins(graph))
        return (*found, notes, mixed, gathered)

    def settled_on(graphs: list) -> tuple:
        for stage, g in zip(graph.stages, graphs):
            stage.graph = g
        return settled()

    found, graphs, _made = written_out([stage.graph for stage in graph.stages], settled(), settled_on)
    found = tp_settle.data_free_whole_where_cheaper(found, lambda wanted: whole.update(wanted) or settled_on(graphs),
                                                    whole)
    settled_on(graphs)
    walks, uses, reasons, notes, mixed, gathered = found
    partial = tp_grads.mark(walks)  # gradients summed once per step: their copies dropped
    result = TPPlan(size=tp)
    if sequence_parallel:
        aliases = graph.symbol_aliases or {}
        expr = sympy.sympify(sequence)
        ours = {sym: sympy.Symbol(aliases[str(sym)]) for sym in expr.free_symbols if str(sym) in aliases}
        result.sequence_parallel = {"sequence": str(expr.xreplace(ours)), "sent": {}}
    roles = _param_roles(walks)
    segments: dict = {}
    for walk in walks:
        segments.update(walk.param_segments)
    mixed_biases = {}
    for walk in walks:
        for _node, (_x, weight, bias, _d, _segments, whole) in walk.mixed_linears.items():
            if bias is not None:
                mixed_biases[walk._param(bias)] = whole
    for fqn, dims in sorted(uses.items()):
        dim = next(iter(dims))
        entry = {"dim": dim, "role": roles.get(fqn, "elementwise") if dim is not None else "replicate"}
        if dim is not None and segments.get(fqn):
            entry["segments"] = list(segments[fqn])
        if fqn in partial:  # each rank's gradient is its part: summed over tp when the step ends
            entry["grad"] = "partial"
        if fqn in notes and dim is None:  # (a note of a pass before the one that placed it sharded: no why)
            entry["why"] = notes[fqn]
        elif fqn in gathered:
            entry["why"] = gathered[fqn]
        elif fqn in mixed or fqn in mixed_biases:
            parts = sorted(mixed.get(fqn) or mixed_biases[fqn])
            entry["why"] = (f"a fused projection whose parts {parts} (key/value heads fewer than --tp) are computed "
                            f"whole; the other parts on this rank's heads, from its rows of this weight")
        elif dim is None:
            entry["why"] = _read_whole_by(walks, fqn)
        result.params[fqn] = entry
    for fqn in partial - set(result.params):  # read only whole, beside shards: listed for its gradient's sum
        walk, user = _first_reader(walks, fqn)
        where = f" ({rules.op_name(user)}{rules.at(user)})" if user is not None else ""
        result.params[fqn] = {"dim": None, "role": "replicate", "grad": "partial",
                              "why": f"read whole beside sharded values{where}: each rank computes its own rows (or "
                                     f"pieces) with all of it, its gradient a part on each rank, summed over tp once "
                                     f"per step"}
    for pattern, how in (overrides or {}).items():
        if how == "replicate":
            continue
        for fqn, entry in result.params.items():
            if any(fnmatch.fnmatchcase(name, pattern) for name in aliases.get(fqn, [fqn])) and entry["role"] != how:
                raise ValueError(f"tp_plan[{pattern!r}] = {how!r}, but {fqn} can only be {entry['role']} in the "
                                 f"traced graph (its input is {'sharded' if entry['role'] == 'rowwise' else 'whole'}"
                                 f" there); use 'replicate' or drop the entry")
    for stage, walk, seen in zip(graph.stages, walks, reasons):
        layers = plan_cost.layer_bytes(walk)
        result.stages.append({"collectives": _collectives(walk), "replicated": list(seen)[:20],
                              "share": _share(walk, result.params, node_flops(stage.graph)),
                              "bytes": plan_cost.moved_bytes(walk),
                              "layers": {layer: list(figures) for layer, figures in layers.items()}})
        for node, name in zip(stage.graph.output_node().args[0], stage.outputs):
            if node in walk.sends:
                result.sent[name] = walk.sends[node][0]
                if sequence_parallel and walk.sends[node][2] == "seq":
                    result.sequence_parallel["sent"][name] = walk.sends[node][0]
    return result, walks


def _norms_over_shards(seen: dict) -> set:
    """Names of the ``layer_norm`` / ``rms_norm`` nodes a pass found normalising over a sharded dim (heads or
    features; their input gathered), from a stage's reasons (``"name (target) at file:line: why"``)."""
    return {reason.split(" ", 1)[0] for reason in seen if reason.endswith(NORM_OVER_SHARD)}


def written_out(graphs: list, found: tuple, settle_on) -> tuple:
    """``found`` (``settle``'s answer over ``graphs``: the walks first, each graph's reasons third) planned again
    with the norms it gathers for normalising over a sharded dim written out (``split.decompose``), on copies of the
    graphs: every graph's at once, else one graph's at a time where several have some (BERT-like: the embeddings'
    norm on the first stage, the head's on the last, whose vocabulary projection would then be row-wise, against its
    tied table); each kept where :func:`_written_out_kept`. ``settle_on(graphs)`` settles a list of graphs. Returns
    (the answer kept, its graphs, {graph index: the nodes made in it})."""
    norms = [_norms_over_shards(seen) for seen in found[2]]
    if not any(norms):
        return found, graphs, {}
    trials = [norms] + ([[names if i == j else set() for i, names in enumerate(norms)] for j in range(len(norms))
                         if norms[j]] if sum(map(bool, norms)) > 1 else [])
    made_all: dict = {}
    for trial in trials:
        copies, made = list(graphs), {}
        for i, names in enumerate(trial):
            if names:
                copies[i] = copy.deepcopy(graphs[i])
                made[i] = decompose.norms(copies[i], names)
        answer = settle_on(copies)
        if _written_out_kept(answer[0], found[0]):
            found, graphs = answer, copies
            made_all.update(made)
            if trial is norms:
                break
    return found, graphs, made_all


def _written_out_kept(written: list, gathered: list) -> bool:
    """The plan with norms over sharded dims written out (``split.decompose``: means over the shards) replaces the
    one that gathers their inputs where it holds no more of a block whole than the cost trials' budget allows
    (``tp_settle.within_budget``) and either costs less (``plan_cost.cost``) or the gathered plan holds more of a
    repeated block (a decoder layer) whole than that budget: torchscale's sub-LayerNorms kept every layer whole, a
    plan of no bytes that no cost at tiny sizes would leave."""
    shares = [[plan_cost.param_shares(walk) for walk in found] for found in (gathered, written)]
    if not within_budget(*shares):
        return False
    return (plan_cost.cost(written) < plan_cost.cost(gathered)
            or any(block is not None for block in _over_budget(*reversed(shares))))


def _check_sequence(sequence, tp: int) -> None:
    if sequence is None:
        raise ValueError("--sequence-parallel splits activations over the sequence dim, and this model has no "
                         "batched input of two or more dims (batch, sequence) to read the sequence length from: "
                         "split without --sequence-parallel")
    if sympy.sympify(sequence).is_Integer and int(sequence) % tp:
        works = [t for t in range(2, int(sequence) + 1) if int(sequence) % t == 0][:8]
        raise ValueError(f"--sequence-parallel with --tp {tp}: the traced sequence length {sequence} does not split "
                         f"into {tp} equal shards; use a sequence length that {tp} divides, or --tp in {works}")


def _read_whole_by(walks: list, fqn: str) -> str:
    """Why a parameter no rule placed is whole, where no walk said: the op that reads it (through views, casts and
    the trace's metadata checks), on every rank alike: a norm's or a scale's weight beside whole values (the
    residual stream, as Megatron keeps them), a row-wise linear's bias (added once, after the sum), a routed expert
    (--ep shards those), or an op no rule starts a shard at (``aten.gru_cell``; a weight rewritten on every call by
    a parametrization, nGPT's ``F.normalize(weight)`` before its linear)."""
    from tracepp.split.expert_parallel import GROUPED_MM

    walk, user = _first_reader(walks, fqn)
    if user is None:
        return "no op of the stages reads it sharded"
    op = (user.target.name() if hasattr(user.target, "name") else str(user.target)).replace("::", ".")
    if op.replace(".", "::", 1) in GROUPED_MM:
        return f"a routed expert ({op}{rules.at(user)}): tensor parallelism keeps routed experts whole; --ep shards them"
    if walk.roles.get(user) == "rowwise":
        return f"the bias of a row-wise linear ({op}{rules.at(user)}): added once, to the summed output"
    if rules.family(user.target) in ("norm", "elementwise"):
        return (f"read beside whole values only ({op}{rules.at(user)}): every rank computes it whole, as "
                f"Megatron keeps its norms' and scales' weights")
    return (f"read whole by {op}{rules.at(user)}, whose inputs are whole: no rule starts a shard there, so "
            f"every rank computes it whole")


def _first_reader(walks: list, fqn: str) -> tuple:
    """(walk, the first op that reads the parameter ``fqn`` through views, casts and the trace's metadata checks),
    or (None, None)."""
    passing = rules.MOVES | rules.VIEWS | rules.KEEP
    for walk in walks:
        for node in walk.graph.nodes:
            if node.op != "placeholder" or walk.fqn_of.get(node.name) != fqn:
                continue
            todo, user = list(node.users), None
            while todo:
                user = todo.pop(0)
                if user.target is torch.ops.aten._assert_tensor_metadata.default:
                    user = None
                elif user.target in passing and len(todo) < 8:
                    todo.extend(user.users)
                    user = None
                else:
                    break
            if user is not None:
                return walk, user
    return None, None


def _share(walk: _Walk, params: dict, flops: dict) -> dict:
    """The stage's sharded share of parameters (elements) and of forward FLOPs (matmuls computed on shards)."""
    total = sharded = 0
    for node in walk.graph.nodes:
        fqn = walk.fqn_of.get(node.name) if node.op == "placeholder" else None
        if fqn is not None:
            count = _val(node).numel()
            total += count
            sharded += count if params.get(fqn, {}).get("dim") is not None else 0
    work = sum(flops.values())
    done = sum(flops.get(n.name, 0) for n in walk.graph.nodes if walk.on_shards(n))
    return {"params": round(sharded / total, 4) if total else 0.0, "flops": round(done / work, 4) if work else 0.0}


def _entry(op: str, node, shape=None) -> dict:
    """One collective as the manifest lists it: the op, the value it follows, the shape it moves (the value's, or
    ``shape``: a fused projection's sharded rows of its weight's gradient) and the dtype."""
    val = _val(node)
    return {"op": op, "after": node.name, "shape": [str(s) for s in (val.shape if shape is None else shape)],
            "dtype": str(val.dtype).replace("torch.", "")}


def _collectives(walk: _Walk) -> list:
    """The communication the rewrite adds to one stage, one line each (``plan_cost.collectives``: forward, and
    what backward adds beyond the mirror of forward)."""
    return [_entry(what, value, shape) for what, value, _belongs, _moved, shape in plan_cost.collectives(walk)]


TUNED_SIZES = (2, 4, 8)


def whole_graph_sequence(graph: fx.Graph, root_inputs: dict):
    """The traced sequence length of the whole traced graph (as :func:`sequence_length` reads a split one): dim 1
    of the first batched root input of two or more dims, or None."""
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    for ref in root_inputs.values():
        node = placeholders.get(ref.placeholder)
        if ref.batched and node is not None and isinstance(_val(node), torch.Tensor) and _val(node).dim() >= 2:
            return _sizes(_val(node))[1]
    return None


def segment_begins(pipeline_graph) -> dict:
    """{segment index: the module it begins at} of the split's segment table (what ``split.blocks`` folds by)."""
    return {index: seg.get("begins") for index, seg in enumerate(pipeline_graph.segments or [])}


def whole_graph_walks(graph: fx.Graph, fqn_of: dict, needs_grad: dict, sizes=TUNED_SIZES, sequence=None,
                      begins: dict = None) -> dict:
    """{tp: the settled walk of the whole traced graph}: the plan ``--tp tp`` would make, seen before any cut
    (stage outputs are not gathered here). With ``sequence`` (the traced sequence length) each tp that divides
    it also gets the walk ``--sequence-parallel`` would make (``entry["sequence_parallel"]``); a walk that
    fails there leaves that tp without it."""
    trainable = {n.name for n, flag in needs_grad.items() if n.op == "placeholder" and flag}

    def flags_of(g: fx.Graph) -> dict:
        return needs_grad if g is graph else _gradient_flags(g, trainable)

    out = {}
    for tp in sizes:
        found, (walked,), made = written_out([graph], settle([(graph, fqn_of, needs_grad)], tp, {}, begins=begins),
                                             lambda gs: settle([(gs[0], fqn_of, flags_of(gs[0]))], tp, {},
                                                               begins=begins))  # as plan() does
        walks, uses, _reasons = found
        flags, made = flags_of(walked), made.get(0)
        tp_grads.mark(walks)
        dims = {fqn: next(iter(d)) for fqn, d in uses.items()}
        out[tp] = {"walk": walks[0], "dims": dims, "attributed": set(), "needs_grad": flags}
        if made is not None:  # a segment's nodes, named in the traced graph, read on the written-out copy
            out[tp]["nodes"] = _by_name(walks[0].graph, made)
        if sequence is None or (sympy.sympify(sequence).is_Integer and int(sequence) % tp):
            continue
        walked = walks[0].graph
        try:
            walks, uses, _reasons = settle([(walked, fqn_of, flags)], tp, {}, sequence=sequence, begins=begins)
            tp_grads.mark(walks)
        except Exception:  # an op the sequence-parallel walk does not expect: tp without it is still priced
            continue
        out[tp]["sequence_parallel"] = {"walk": walks[0], "dims": {fqn: next(iter(d)) for fqn, d in uses.items()},
                                        "attributed": set(), "needs_grad": flags}
        if made is not None:
            out[tp]["sequence_parallel"]["nodes"] = out[tp]["nodes"]
    return out


def segment_figures(nodes: list, walks: dict, flops: dict, tensor_bytes, crossing=()) -> dict:
    """Per tp size, for one segment's nodes (the tuner prices a segment at tp with these): the forward FLOPs
    computed on shards, the parameters sharded (counted at the segment of their first use), the collectives per
    microbatch: forward all-reduces (row-wise outputs, vocabulary lookups, sums over the pieces), backward
    all-reduces (gradients of the replicated inputs of sharded ops), all-gathers, and backward all-gathers (the
    gradient pieces of whole values read at a rank's piece: ``plan_cost.backward_gathers``), each as [count, bytes
    of the whole tensors]; and ``sharded_activation_bytes``: the activations (floating values that carry a
    gradient, as ``split.cost`` counts them) computed on shards, each rank holding 1/tp of them.

    Where the whole graph was also walked with sequence parallelism, ``["sequence_parallel"]`` holds the same
    figures for that plan plus ``sequence_activation_bytes`` (the activations sharded over the sequence:
    norms and residual adds between the regions, and the inputs of column-parallel regions, whose linears keep
    the shard for backward and gather it again there: ``runtime.tensor_parallel.shards_kept_for_backward``),
    ``reduce_scatter`` (the row-wise outputs and vocabulary
    lookups, in place of their all-reduce) and ``all_gather_sequence`` (into each column-parallel region),
    each [count, bytes of the whole tensors] (backward mirrors them: an all-gather and a reduce-scatter), and
    ``cut_sequence_bytes`` / ``cut_sequence_grad_bytes``: of the values ``crossing`` the cut before this
    segment (``split.partition.segment_table``'s), those a pipeline boundary would carry as sequence shards."""
    out = {}
    for tp, entry in walks.items():
        out[str(tp)] = _figures(nodes, entry, flops, tensor_bytes)
        if "sequence_parallel" in entry:
            out[str(tp)]["sequence_parallel"] = _figures(nodes, entry["sequence_parallel"], flops, tensor_bytes,
                                                         crossing)
    return out


def _by_name(written: fx.Graph, made: dict) -> dict:
    """{name in the traced graph: its nodes in ``written``} (a norm written out: the nodes made for it)."""
    out = {node.name: [node] for node in written.nodes}
    out.update(made)
    return out


def _figures(nodes: list, entry: dict, flops: dict, tensor_bytes, crossing=None) -> dict:
    """``segment_figures`` of one walk (``crossing`` given: the sequence-parallel walk, with its extra figures)."""
    walk, dims, attributed, needs_grad = entry["walk"], entry["dims"], entry["attributed"], entry["needs_grad"]
    if "nodes" in entry:
        nodes = [mine for node in nodes for mine in entry["nodes"].get(node.name, ())]
    inside = set(nodes)
    sharded_flops = sum(flops.get(n.name, 0) for n in nodes  # column-wise outputs are in walk.shard
                        if n in walk.shard or walk.roles.get(n) == "rowwise")
    params = bytes_ = 0
    for node in nodes:
        for arg in node.all_input_nodes:
            fqn = walk._param(arg) if arg.op == "placeholder" else None
            if fqn is not None and fqn not in attributed:
                attributed.add(fqn)
                if dims.get(fqn) is not None:
                    params += _val(arg).numel()
                    bytes_ += held_bytes(arg)

    def activation(node) -> bool:
        val = _val(node)
        return bool(needs_grad.get(node)) and isinstance(val, torch.Tensor) and val.dtype.is_floating_point

    def total(found) -> list:
        found = list(found)
        return [len(found), sum(tensor_bytes(_val(n)) for n in found)]

    scattered = [n for n in nodes if n in walk.reduce_scatters]
    reduce_fwd = [n for n in nodes if (walk.roles.get(n) in ("rowwise", "vocab") and n not in walk.reduce_scatters
                                       and n not in walk.deferred) or n in walk.sums or n in walk.late_sums]
    reduce_fwd += [plan_cost.values_of(n) for n in nodes if n in walk.maxes]
    copied = {value for reader, value in tp_grads.backward_reads(walk) if reader in inside}
    gathered = {arg for consumer, arg in walk.gathers if consumer in inside or (consumer.op == "output"
                                                                                and arg in inside)}
    gathered_back = [moved for reader, _value, moved, _shape in plan_cost.backward_gathers(walk) if reader in inside]
    figures = {
        "sharded_flops": int(sharded_flops), "sharded_params": int(params), "sharded_param_bytes": int(bytes_),
        "all_reduce": total(reduce_fwd), "all_reduce_backward": total(copied), "all_gather": total(gathered),
        "all_gather_backward": [len(gathered_back), int(sum(gathered_back))],
        "sharded_activation_bytes": sum(tensor_bytes(_val(n)) for n in nodes
                                        if n in walk.shard and walk.kind.get(n) != "seq" and activation(n))}
    if crossing is None:
        return figures
    entering = dict.fromkeys(arg for consumer, arg in walk.sp_gathers if consumer in inside)
    sent = [n for n in crossing if walk.kind.get(n) == "seq" and n in walk.shard]
    figures.update({  # a region's input too: its linears keep the shard (gathered again in backward)
        "sequence_activation_bytes": sum(tensor_bytes(_val(n)) for n in nodes if walk.kind.get(n) == "seq"
                                         and n in walk.shard and activation(n)),
        "reduce_scatter": total(scattered), "all_gather_sequence": total(entering),
        "cut_sequence_bytes": sum(tensor_bytes(_val(n)) for n in sent),
        "cut_sequence_grad_bytes": sum(tensor_bytes(_val(n)) for n in sent if activation(n))})
    return figures

