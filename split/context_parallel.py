"""Context parallelism read from the traced graph: each sample's sequence spread over ``--cp`` ranks, and the
stage graphs (and the loss) rewritten so that every rank computes its positions exactly.

Each sequence of the traced length ``S`` is cut into ``2 x cp`` chunks and cp rank ``r`` holds chunks ``r`` and
``2 x cp - 1 - r`` (``runtime/context_parallel.py``). Every value of a stage graph gets a placement: **whole**
(every cp rank holds all of it: parameters, positions, masks, rotary tables made inside ``forward``) or a
**sequence shard** on one dim (this rank's positions of ``groups`` sequences side by side; a ``[batch * seq]``
token dim has one sequence per sample). Walking each stage graph in order:

* the shards begin where the model turns token ids into activations: an ``embedding`` of a whole batched input
  with the sequence dim cuts the ids to this rank's positions (``cp_shard``), as does any floating batched input
  with the sequence dim (``inputs_embeds``) where an op that carries a gradient first reads it;
* ops that keep positions apart carry the shard: every pointwise op (``torch.Tag.pointwise``), casts, views that
  keep the sequence whole inside one dim (split into heads, merged with the batch or the features, split back;
  ``view_as_complex`` and ``view_as_real``, which regroup the last dim only), transposes, linears and matmuls over other dims, norms and softmaxes over the features, reductions over other
  dims, slices, splits and concatenations of other dims, ``repeat_interleave`` of heads, embeddings of sharded
  ids, indexing of whole tables by sharded positions (``cos[position_ids]``);
* a **whole value met beside a shard** (a rotary table, a learned position embedding's lookup, the rows of a
  causal or sliding-window mask, a target) is made whole and cut to this rank's positions (``cp_shard``), where
  the shard meets it, and the cut is moved up to the positions it was made from where it can be (so a mask is
  built for this rank's query rows only);
* **attention**: ``scaled_dot_product_attention`` (its aten form, GQA with repeated heads or ``enable_gqa``,
  MLA's), and eager ``q @ k.T -> (+ mask) -> softmax -> @ v`` (or ``baddbmm(bias, q, k.T)``, the bias cut to the
  query rows where it has them): the keys and values are all-gathered over cp in sequence order
  (``cp_all_gather``; backward reduce-scatters dK and dV), moved up past head repeats so the gather carries the
  key/value heads only; the local queries attend with the mask cut to their rows; ``is_causal`` becomes a mask
  from this rank's query positions (``cp_positions``);
* **a sum or mean over the sequence** is computed from partial sums: the local sum, ``cp_all_reduce``, divided
  by the whole count; the loss (``cross_entropy``, ``nll_loss``, ``mse_loss``..., traced from the model file's
  ``loss_fn``) with ``reduction='mean'`` becomes a sum and a count, both all-reduced, so targets with
  ``ignore_index`` spread unevenly over the ranks give eager's loss;
* **a maximum over the sequence** (``amax``, the values of ``max.dim``: AFT's and Performer's stabilisers) is each
  rank's maximum, all-reduced with max (``cp_amax``), its gradient shared among the positions holding it on every
  rank; the index of a maximum, a minimum and any other partial kind are refused by name;
* inside a block of routed experts (``split.expert_parallel.find_blocks``), whose every token is computed on its
  own (dropless routing), sorting and gathering this rank's tokens is local: sizes that count tokens become local;
* anything else that mixes positions (a centred convolution along the sequence, a loop over positions, a gather of
  positions, a concatenation along the sequence, an attention mask given as an input of the model) runs on the
  whole sequence at every cp rank: its shards all-gathered, its outputs whole and cut back where they meet a shard
  (``cp_walk._Walk._run_whole``), named in the split's notes; ``--verify strict`` refuses it by name, with the op
  and the model's source line.

A value that crosses a stage boundary as a shard is sent as it is (1/cp of the bytes; its manifest shape is the
local one). The result, :class:`CPPlan`, is plain data for the manifest; :func:`apply` rewrites the graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.cp_rewrite import (_GATHER_THROUGH, _stage_record, apply,  # noqa: F401  (the driver calls apply
                                       whole_record)                          # here)
from tracepp.split.cp_walk import WORK, ContextParallelError, _Walk, _int, _sizes  # noqa: F401  (tests count WORK)
from tracepp.split.rules import val as _val, where
from tracepp.split.tensor_parallel import sequence_input, sequence_length
from tracepp.split.tp_settle import fqn_map, grad_flags

aten = torch.ops.aten
CP = torch.ops.tracepp


@dataclass
class CPPlan:
    """Plain data for the manifest: the cp size, the traced sequence length, and per stage what the rewrite
    added (cuts of whole values, key/value all-gathers with their bytes, sums over the sequence); the values
    sent as shards; the loss's sum-and-count."""

    size: int
    sequence: str  # the traced sequence length (an int or an expression over the root symbols)
    stages: list = field(default_factory=list)  # per stage: {"cut", "gathered", "reduced", "kv_bytes", ...}
    sent: dict = field(default_factory=dict)  # value name -> the dim it is sent sharded on
    outputs: list = field(default_factory=list)  # per model output leaf: [dim, groups] of its shard, or None
    loss: dict = field(default_factory=dict)  # {"reductions": [...], "cut": [...]}

    def to_json(self) -> dict:
        return {"size": self.size, "sequence": self.sequence, "order": "2cp chunks: rank r holds r and 2cp-1-r",
                "stages": self.stages, "sent": self.sent, "outputs": self.outputs, "loss": self.loss}


# ---- the plan

def _expert_nodes(stage_graph: fx.Graph, fqn_of: dict) -> set:
    """The nodes of each routed-expert layer: from its token rows to the sum over the top-k experts, every node
    of the module that owns the experts' router (dropless: each token computed on its own). Experts as grouped
    matmuls, or called one by one on the rows ``torch.where`` picks (litgpt's ``LLaMAMoE``)."""
    from tracepp.split.expert_parallel import find_blocks, looped_experts
    from tracepp.split.partition import node_modules

    names = [block.name for block in find_blocks(stage_graph, fqn_of)] + list(looped_experts(stage_graph))
    if not names:
        return set()
    owners = {name.rsplit(".", 1)[0] if "." in name else name for name in names}
    found = set()
    for node in stage_graph.nodes:
        paths = [p for p in node_modules(node) if p]
        if any(p == o or p.startswith(o + ".") for p in paths for o in owners):
            found.add(node)
    return found


def first_reader(stage) -> str:
    """``ids (placeholder) are first read by op (aten op) at model.py:42``: the first stage's token ids (its first
    integer input of 2+ dims) and the op that first reads them, or ''."""
    for node in stage.graph.nodes:
        val = node.meta.get("val")
        if (node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 2
                and not val.dtype.is_floating_point and val.dtype != torch.bool and node.users):
            user = next(iter(node.users))
            line = f" at {where(user)}" if where(user) else ""
            return f"its token ids ({node.name}) are first read by {user.name} ({rules.op_name(user)}){line}"
    return ""


def _first_reader(stage) -> str:
    """Where the first stage's token ids go instead of an embedding (infini-transformer splits them into segments
    first: ``ids.split(segment)``), for the refusal's text."""
    found = first_reader(stage)
    return f": {found}, not by an embedding (cut the sequence in batch(step), not inside the model)" if found else ""


def plan(graph, cp: int, loss=None, training: bool = True, whole: bool = True,
         forced: frozenset = frozenset()) -> tuple:
    """(CPPlan, the walk per stage, the loss's walk or None): :func:`_plan`, made again while an op run on the whole
    sequence gathers a value the graph writes into in place (RWKV's and recurrentgemma's ``output[:, i] = ...`` of a
    ``zeros_like``, position by position): that value is made whole where it is created, so the writes land in it."""
    while True:
        result, walks, loss_walk = _plan(graph, cp, loss, training, whole, forced)
        more = {key for walk in walks + [loss_walk] if walk is not None for key in walk.rewalk} - forced
        if not more:
            return result, walks, loss_walk
        forced = frozenset(forced | more)


def _plan(graph, cp: int, loss=None, training: bool = True, whole: bool = True,
          forced: frozenset = frozenset()) -> tuple:
    """(CPPlan, the walk per stage, the loss's walk or None) for ``--cp cp``. ``loss``: the traced loss
    (:class:`LossGraph`), walked with the last stage's output placements. ``whole``: an op no rule places runs on
    the whole sequence at every cp rank (``cp_walk._Walk._run_whole``, named in the plan's notes); False refuses
    it by name (``--verify strict``). ``forced``: (op, source line) pairs run on the whole sequence wherever they
    are (what verification found placed wrong: ``verify_cp.check``)."""
    seq = sequence_length(graph)
    _check_sequence(seq, cp, graph)
    aliases = graph.symbol_aliases or {}
    expr = sympy.sympify(seq)
    ours = {sym: sympy.Symbol(aliases[str(sym)]) for sym in expr.free_symbols if str(sym) in aliases}
    result = CPPlan(size=cp, sequence=str(expr.xreplace(ours)))
    from tracepp.split import blocks
    from tracepp.split.tensor_parallel import segment_begins

    walks, sent = [], {}
    begins = segment_begins(graph)
    for stage in graph.stages:
        nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
        first = len(stage.state) + len(stage.root_inputs)
        received = {nodes[first + i].name: sent.get(name) for i, (_producer, name) in enumerate(stage.received)}
        fqn_of = fqn_map(stage, graph)
        flags = grad_flags(stage, graph)
        experts = _expert_nodes(stage.graph, fqn_of)
        last = stage.index == graph.num_stages - 1

        def build(g, into, flags=flags, experts=experts, received=received, last=last, fqn_of=fqn_of):
            mapped = {into(n): f for n, f in flags.items() if into(n) is not None}
            return _Walk(g, seq, cp, mapped, received, {into(n) for n in experts} - {None}, training, last,
                         fqn_of=fqn_of, whole=whole, forced=forced)

        walk = blocks.walk_once(stage.graph, fqn_of, begins, build,
                                lambda w: (w.shard, w.items, w.sums, w.local_factories),
                                {"graph": stage.graph, "needs_grad": flags, "fqn_of": fqn_of,
                                 "expert_nodes": experts, "received": received})
        outputs = list(stage.graph.output_node().args[0])
        for node, name in zip(outputs, stage.outputs):
            if isinstance(node, fx.Node) and node in walk.sends:
                sent[name] = walk.sends[node]
        walks.append(walk)
    loss_walk = None
    last = walks[-1]
    result.outputs = [list(p) if p is not None else None for p in last.outputs]
    if loss is not None:
        loss_seq = loss.sequence(result.outputs)
        received = {name: (tuple(result.outputs[i]) if i is not None and i < len(result.outputs)
                           and result.outputs[i] else None) for name, i in loss.inputs.items()}
        loss_walk = _Walk(loss.graph, loss_seq, cp, {}, received, training=True, loss=True, whole=whole,
                          forced=forced)
        ends = loss_walk.outputs
        if any(p is not None for p in ends):
            loss_walk.refusals.append("the loss function returns values that still hold only this rank's positions "
                                      "(a per-token loss): reduce it over the tokens (mean or sum) in loss_fn")
    refusals = [text for walk in walks + ([loss_walk] if loss_walk else []) for text in walk.refusals]
    if not any(walk.shard for walk in walks[:1]):
        refusals.append("no value of the first stage holds a sequence shard: --cp starts at an embedding of "
                        "token ids with the sequence dim (or a floating input with it, read by an op that "
                        "carries a gradient); the model has none" + _first_reader(graph.stages[0]))
    if refusals:
        more = f" (and {len(refusals) - 8} more)" if len(refusals) > 8 else ""
        raise ContextParallelError(f"--cp {cp} cannot spread this model's sequence over its ranks:\n  "
                                   + "\n  ".join(refusals[:8]) + more)
    for stage, walk in zip(graph.stages, walks):
        result.stages.append(_stage_record(walk))
        for node, name in zip(stage.graph.output_node().args[0], stage.outputs):
            if isinstance(node, fx.Node) and node in walk.sends and stage.index < graph.num_stages - 1:
                result.sent[name] = walk.sends[node][0]
    if loss_walk is not None:
        result.loss = {"reductions": [{"op": rules.op_name(n), "reduction": how, "line": where(n)}
                                      for n, how in loss_walk.losses.items()]
                       + [{"op": rules.op_name(n), "reduction": "sum" if c is None else "mean", "line": where(n)}
                          for n, c in loss_walk.sums.items()],
                       "cut": sorted({a.name for _c, a, _d, _g in loss_walk.cuts}),
                       "whole": whole_record(loss_walk)}
    return result, walks, loss_walk


def whole_note(cp_plan: CPPlan) -> str:
    """The plan's note on the ops it runs on the whole sequence at every cp rank (``cp_walk._Walk._run_whole``),
    grouped by op and source line, with the bytes gathered for them; '' where there are none."""
    found, gathered = {}, 0
    for index, stage in enumerate(cp_plan.stages):
        gathered += stage.get("whole_bytes", 0)
        for item in stage.get("whole", []):
            found.setdefault((item["op"], item["line"], f"stage {index}"), []).append(item)
    for item in (cp_plan.loss or {}).get("whole", []):
        found.setdefault((item["op"], item["line"], "the loss"), []).append(item)
    if not found:
        return ""
    shown = []
    for (op, line, where_), items in list(found.items())[:6]:
        count = f" x {len(items)}" if len(items) > 1 else ""
        shown.append(f"{op}{count}{' at ' + line if line else ''} ({where_}: {items[0]['why']})")
    more = f"; and {len(found) - 6} more ops" if len(found) > 6 else ""
    total = sum(len(items) for items in found.values())
    return (f"--cp {cp_plan.size}: {total} op(s) no context-parallel rule places run on the whole sequence at every "
            f"cp rank: " + "; ".join(shown) + more + f". Their sequence shards are all-gathered first "
            f"({gathered:,} bytes per microbatch, whole) and what they make is cut back to each rank's positions "
            f"where it meets a shard: exact, but that compute and its activations are not divided by cp "
            f"(`tracepp inspect` lists them; --verify strict refuses instead)")


def _check_sequence(seq, cp: int, graph) -> None:
    if seq is None:
        raise ContextParallelError("--cp spreads each sample's sequence over its ranks, and this model has no "
                                   "batched input of two or more dims (batch, sequence) to read the sequence "
                                   "length from: split without --cp")
    length = _int(seq)
    if length is not None and length % (2 * cp):
        works = [c for c in range(2, length // 2 + 1) if length % (2 * c) == 0][:8]
        why = "odd" if length % 2 else "too short"
        cuts = _sequence_cuts(graph)
        shifted = (f". The model cuts that input along the sequence itself ({cuts}): its tokens and its labels, "
                   f"one position apart, as an autoregressive wrapper shifts a sequence of L + 1 tokens; cp spreads "
                   f"the input it is given, so give the model the L tokens to read (its labels in the target, its "
                   f"loss in loss_fn), or split without --cp") if cuts else ""
        raise ContextParallelError(
            f"--cp {cp}: the traced sequence length {length} does not cut into 2 x cp = {2 * cp} equal chunks "
            f"(rank r holds chunks r and {2 * cp - 1}-r); use a sequence length that {2 * cp} divides, or --cp in "
            f"{works or f'[none: {length} is {why}]'}{shifted}")


def _sequence_cuts(graph) -> str:
    """The slices along the sequence dim of the input the sequence length is read from (``seq[:, :-1]`` and
    ``seq[:, 1:]``), named with their lines, or ''."""
    seq_dim = 1 - getattr(graph, "batch_dim", 0)
    found = [f"slice (aten.slice.Tensor){rules.at(user)}" for node in sequence_input(graph) for user in node.users
             if user.target is aten.slice.Tensor and rules.arg(user, 1, "dim", 0) % _val(node).dim() == seq_dim]
    return ", ".join(dict.fromkeys(found))




# ---- the loss, traced from the model file's loss_fn

@dataclass
class LossGraph:
    """The model file's ``loss_fn(output, target)`` traced (``tracepp/trace_loss.py``): its graph takes the
    model output's tensor leaves, then the target's leaves. ``inputs``: placeholder name -> the model output
    leaf it stands for (None: a target leaf)."""

    graph: fx.Graph
    inputs: dict  # placeholder name -> output leaf index, or None for a target leaf
    target_spec: object = None
    output_count: int = 0  # how many output leaves come first

    def sequence(self, outputs: list):
        """The loss graph's own sequence length: that of the first sharded output leaf."""
        for name, index in self.inputs.items():
            if index is not None and index < len(outputs) and outputs[index]:
                dim, groups = outputs[index]
                node = next(n for n in self.graph.nodes if n.op == "placeholder" and n.name == name)
                sizes = _sizes(_val(node))
                if dim >= len(sizes):
                    raise ContextParallelError(
                        f"--cp cannot place the loss's inputs: loss_fn reads output leaf {index} as {name} of "
                        f"{len(sizes)} dims, which the last stage sends sharded on dim {dim}: the output's leaves do "
                        f"not line up with loss_fn's; return only the tensors the loss reads (use_cache=False for a "
                        f"cache object), or split without --cp")
                return sympy.sympify(sizes[dim] / groups)
        return None


def loss_callable(loss: LossGraph):
    """``loss_fn(output, target)`` running the rewritten loss graph as the last rank's script does (for planning on
    fake tensors: ``codegen.memory``)."""
    import torch.utils._pytree as pytree

    graph = fx.Graph()  # export's checks of the traced device and dtype dropped, as the rank script drops them (a
    graph.output(graph.graph_copy(loss.graph, {}))  # count on meta tensors failed them: "Expected: meta, Got: cpu")
    rules.drop_metadata_asserts(graph)
    module = fx.GraphModule(torch.nn.Module(), graph)

    def loss_fn(output, target):
        leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        out = module(*leaves, *pytree.tree_leaves(target))
        return out[0] if isinstance(out, (tuple, list)) else out
    return loss_fn


# ---- what cp would change, per segment (the tuner's figures)

def segment_figures(graph: fx.Graph, compute: list, segments: list, root_inputs: dict, fqn_of: dict,
                    needs_grad: dict, flops: dict, computable: set, tensor_bytes) -> None:
    """Add ``segments[k]["cp"]`` for ``plan --tune --cp-sizes``: the whole traced graph walked once (the
    placements do not depend on the cp size), and per segment of the table (``split.partition.segment_table``,
    nodes marked with their segment): ``sharded_flops`` (computed on sequence shards: 1/cp of them per rank;
    attention's too, each rank's queries against every key), ``sequence_activation_bytes`` (the floating values
    that carry a gradient and hold a shard: 1/cp kept per rank), ``kv_gather`` ([count, whole bytes] of the
    key/value all-gathers, as moved up past head repeats: each rank receives (cp - 1)/cp of them forward and sends
    as much back as dK/dV), ``sums`` ([count, bytes] of the partial sums all-reduced) and, of the values crossing
    the cut before the segment, those sent as shards (``cut_sequence_bytes``, ``cut_sequence_grad_bytes``: 1/cp
    of them per rank). A model the walk refuses gets ``{"refused": why}``; the traced ``sequence`` length says
    which cp sizes cut it into 2 x cp chunks."""
    from tracepp.split.partition import SEGMENT
    from tracepp.split.tensor_parallel import whole_graph_sequence

    seq = whole_graph_sequence(graph, root_inputs)
    if seq is None or not segments:
        return
    try:
        walk = _Walk(graph, seq, 2, needs_grad, {}, _expert_nodes(graph, fqn_of), True, True, fqn_of=fqn_of)
    except Exception as error:  # noqa: BLE001 - the table only serves the tuner: never fail a split for it
        walk, refused = None, f"{type(error).__name__}: {error}"
    else:
        refused = walk.refusals[0] if walk.refusals else None
    text = str(seq)
    if refused is not None or walk is None:
        for seg in segments:
            seg["cp"] = {"refused": refused, "sequence": text}
        return
    position = {node: index for index, node in enumerate(compute)}
    last_use: dict = {}
    for node in compute:
        for arg in node.all_input_nodes:
            if arg in position:
                last_use[arg] = max(last_use.get(arg, -1), position[node])
        if any(user.op == "output" for user in node.users):
            last_use[node] = len(compute)
    by_segment: dict = {}
    for node in compute:
        by_segment.setdefault(node.meta.get(SEGMENT), []).append(node)

    def floating_grad(node) -> bool:
        val = _val(node)
        return bool(needs_grad.get(node)) and isinstance(val, torch.Tensor) and val.dtype.is_floating_point

    for index, seg in enumerate(segments):
        nodes = by_segment.get(index, [])
        inside = set(nodes)
        held = [n for n in nodes if n in walk.shard or n in walk.items]
        gathered = dict.fromkeys(_gather_source(arg, walk) for consumer, arg in walk.gathers if consumer in inside)
        wholes = dict.fromkeys(arg for consumer, arg in walk.whole_gathers if consumer in inside)
        sums = [n for n in nodes if n in walk.sums]
        crossing = []
        if index and nodes:
            start = position[nodes[0]]
            crossing = [n for n in compute[:start] if last_use.get(n, -1) >= start and n not in computable
                        and isinstance(_val(n), torch.Tensor)]
        sent = [n for n in crossing if n in walk.shard]
        seg["cp"] = {
            "sequence": text,
            "sharded_flops": int(sum(flops.get(n.name, 0) for n in held)),
            "sequence_activation_bytes": int(sum(tensor_bytes(_val(n)) for n in nodes if n in walk.shard
                                                 and floating_grad(n))),
            "kv_gather": [len(gathered), int(sum(tensor_bytes(_val(n)) for n in gathered))],
            "whole_gather": [len(wholes), int(sum(tensor_bytes(_val(n)) for n in wholes))],
            "sums": [len(sums), int(sum(tensor_bytes(_val(n)) for n in sums if isinstance(_val(n), torch.Tensor)))],
            "cut_sequence_bytes": int(sum(tensor_bytes(_val(n)) for n in sent)),
            "cut_sequence_grad_bytes": int(sum(tensor_bytes(_val(n)) for n in sent if floating_grad(n))),
        }


def _gather_source(arg, walk: _Walk):
    """The value a key/value gather of ``arg`` moves up to (past the ops that only repeat heads): what
    :class:`_Hoist` makes the all-gather carry."""
    while (arg.op == "call_function" and arg.target in _GATHER_THROUGH and len(arg.users) == 1
           and isinstance(arg.args[0], fx.Node) and arg.args[0] in walk.shard):
        arg = arg.args[0]
    return arg

