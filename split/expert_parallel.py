"""Expert parallelism read from the traced graph: the routed experts of each stage found, sharded over ``--ep``
ranks, and each block of them rewritten to exchange its (token, expert) rows with an all-to-all.

A block of routed experts is what a mixture-of-experts layer computes after its router: the rows of this
rank's (token, expert) pairs sorted by expert, the cumulative count per expert (``offsets``), and a chain of
grouped matmuls over the expert dim that share those offsets (gate/up, then down), written in any of the three
spellings the FLOP count knows: ``torch._grouped_mm``, ``torch.nn.functional.grouped_mm`` and transformers'
``grouped_mm_fallback``. The router, its top-k, the weighting of each expert's output and the sum over the k
experts of a token stay where they are (on the token's own rank), and so do shared experts and dense layers:
only the grouped matmuls move. Each block becomes::

    local_rows, local_offsets, plan = tracepp.ep_dispatch(rows, offsets, num_experts, block)
    ... the same grouped matmuls, on this rank's experts, with local_offsets ...
    out = tracepp.ep_combine(expert_out, plan, rows.shape[0])

and each expert weight (``[num_experts, ...]``) is sharded on its expert dim (``Shard(0)``): ep rank r holds
experts ``[r * E / ep, (r + 1) * E / ep)``. The weight is the grouped matmul's operand followed back through casts
and views that keep the expert dim whole (torchtitan's ``w.bfloat16().transpose(-2, -1)`` of weights stored
``[experts, out, in]``); a parameter whose experts lie on another dim, brought to dim 0 by a permute, is sharded
on that dim (the plan's ``"dim"``). Where the matmuls cast the rows apart (torchtitan's gate and up each call
``x.bfloat16()``), the rows they all cast from are dispatched once and the casts run after the dispatch.
Without ``--ep`` the blocks are still found, and their offsets pass through ``tracepp.moe_tokens`` so the run can
report tokens per expert.

Expert biases (GPT-OSS: ``gate_up_proj_bias[expert_ids]``, a bias per expert gathered for each sorted row and
added to the grouped matmul's output) move with their rows: after dispatch each row keeps the index of its local
expert (``tracepp.ep_expert_ids(local_offsets, local_rows)``), the bias (``[experts, ...]``, sharded on its
expert dim like the weights) is gathered with those indices on the expert's rank, and a bias added after the
last grouped matmul stays where it is (on the token's rank, whole).

Whatever does not fit is refused by name: an expert weight used outside grouped matmuls, per-row inputs
inside the chain other than a per-expert parameter gathered by the sorted expert ids, a chain that does not end
in one grouped matmul.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

import tracepp.runtime.expert_parallel  # noqa: F401  (registers torch.ops.tracepp.ep_*)
from tracepp.split import ep_walk, rules
from tracepp.split.cost import as_int, held_bytes, op_name, tensor_bytes
from tracepp.split.partition import listed_module, node_modules

aten = torch.ops.aten
GROUPED_MM = ("aten::_grouped_mm", "aten::grouped_mm", "transformers::grouped_mm_fallback", "tracepp::grouped_mm")


class ExpertParallelError(ValueError):
    """A model ``--ep`` cannot shard: the message names the op and the values that would work."""


@dataclass
class MoEBlock:
    """One block of routed experts in a stage graph."""

    name: str  # the module that owns the experts ("model.layers.3.mlp.experts")
    offsets: fx.Node  # cumulative tokens per expert
    matmuls: list  # the grouped matmuls, in graph order
    weights: dict  # expert weight fqn -> its placeholder
    num_experts: int
    rows: fx.Node = None  # the first matmul's input: the sorted (token, expert) rows
    refused: str = ""  # why --ep cannot shard it
    sentinel_fills: list = field(default_factory=list)  # masked_fill of rows routed to no expert (see _sentinel)
    fqn_of: dict = None  # placeholder name -> parameter fqn of the stage
    biases: dict = field(default_factory=dict)  # per-expert parameter fqn -> its placeholder (expert biases)
    gathers: list = field(default_factory=list)  # index(bias, [sorted expert ids]) nodes read inside the chain
    expert_dims: dict = field(default_factory=dict)  # expert weight fqn -> its expert dim (the matmuls' dim 0)
    weight_paths: list = field(default_factory=list)  # (node, expert dim): casts and views of the weights
    placed: set = field(default_factory=set)  # the rows and every value the walk placed on them (``ep_walk``)

    @property
    def out(self) -> fx.Node:
        return self.matmuls[-1]


@dataclass
class EPPlan:
    """Plain data for the manifest: the ep size, each expert weight's placement, each block's exchange."""

    size: int
    params: dict = field(default_factory=dict)  # fqn -> {"dim": 0, "experts": E, "shape": [...], "local": [...]}
    blocks: list = field(default_factory=list)  # {"name", "stage", "experts", "rows", "row_bytes", ...}

    def to_json(self) -> dict:
        return {"size": self.size, "params": self.params, "blocks": self.blocks}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


# what a grouped matmul's expert weight operand may pass through from its parameter: the same weight, its expert
# dim kept apart from the others (torchtitan: ``w.bfloat16().transpose(-2, -1)``, its weights stored [experts,
# out, in] like one nn.Linear per expert)
_WEIGHT_CASTS = rules.CASTS | {aten.type_as.default}
_ROW_CASTS = _WEIGHT_CASTS  # and what the rows may pass through into each grouped matmul (``x.bfloat16()``)


@dataclass
class ExpertWeight:
    """A grouped matmul's expert weight operand, followed back to its parameter."""

    fqn: str
    placeholder: fx.Node
    dim: int  # the parameter's expert dim (the grouped matmul's dim 0)
    path: list  # (node, its expert dim), from the parameter's first view or cast to the matmul's operand


def _expert_dim_before(node, dim: int):
    """The dim of ``node``'s input that is ``node``'s output dim ``dim``, when ``node`` is a cast or a view that
    moves whole dims (a transpose, a permute), else None."""
    if node.target in _WEIGHT_CASTS:
        return dim
    if node.target not in rules.TRANSPOSES or not isinstance(_val(node.args[0]), torch.Tensor):
        return None
    return next((d for d in range(_val(node.args[0]).dim()) if rules.moved_dim(node, d) == dim), None)


def _weight(node, fqn_of: dict):
    """The :class:`ExpertWeight` a grouped matmul multiplies by: a 3-D parameter, itself or through casts and views
    that keep its expert dim whole (the operand's dim 0, any dim of the parameter), else None."""
    dim, path = 0, []
    while isinstance(node, fx.Node) and node.op == "call_function":
        before = _expert_dim_before(node, dim)
        if before is None or not isinstance(node.args[0], fx.Node):
            return None
        path.append((node, dim))
        node, dim = node.args[0], before
    if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in fqn_of and _val(node).dim() == 3:
        return ExpertWeight(fqn_of[node.name], node, dim, path[::-1])
    return None


def _rows_of(matmuls: list):
    """The rows the block's grouped matmuls read: the first matmul's input, or where several matmuls read the
    rows apart (torchtitan's gate and up: ``_grouped_mm(x.bfloat16(), w1...)``, ``_grouped_mm(x.bfloat16(),
    w3...)``) the node they all cast from; None when they read different rows."""
    members, reached = set(matmuls), set()  # what a matmul of the block computes from (matmuls in graph order)
    for node in ep_walk.span(matmuls[0], matmuls[-1]):
        if any(a in members or a in reached for a in node.all_input_nodes):
            reached.add(node)
    entries = [m for m in matmuls if m not in reached]
    chains = []
    for matmul in entries:
        chain, node = [], matmul.args[0]
        while isinstance(node, fx.Node):
            chain.append(node)
            if node.target not in _ROW_CASTS or not isinstance(node.args[0], fx.Node):
                break
            node = node.args[0]
        chains.append(chain)
    common = [n for n in chains[0] if all(n in chain for chain in chains[1:])]
    return common[0] if common else None


def _module(node) -> str:
    paths = [p for p in node_modules(node) if p and not p.startswith("_empty")]
    return paths[-1] if paths else listed_module(node)


def find_blocks(graph: fx.Graph, fqn_of: dict) -> list:
    """The blocks of routed experts in a stage graph (``fqn_of``: placeholder name -> parameter FQN)."""
    by_offsets: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or op_name(node) not in GROUPED_MM:
            continue
        offsets = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
        by_offsets.setdefault(offsets, []).append(node)
    blocks = []
    for offsets, matmuls in by_offsets.items():
        weights, expert_weights, refused = {}, [], ""
        for matmul in matmuls:
            found = _weight(matmul.args[1], fqn_of)
            if found is None:
                refused = (f"{matmul.name} ({op_name(matmul)}) multiplies by {matmul.args[1]}"
                           f"{rules.at(matmul)}, which is not an expert weight parameter (3-D, its expert dim "
                           f"the grouped matmul's dim 0) nor one through casts, transposes or permutes")
                continue
            weights[found.fqn] = found.placeholder
            expert_weights.append(found)
        dims = {w.fqn: w.dim for w in expert_weights}
        counts = {int(_val(w.placeholder).shape[w.dim]) for w in expert_weights}
        rows = _rows_of(matmuls)
        paths = list(dict.fromkeys(step for w in expert_weights for step in w.path))  # a view two matmuls read: once
        block = MoEBlock(_module(matmuls[0]), offsets, matmuls, weights, max(counts) if counts else 0,
                         rows=rows if rows is not None else matmuls[0].args[0], refused=refused, fqn_of=fqn_of,
                         expert_dims=dims, weight_paths=paths)
        twice = sorted({w.fqn for w in expert_weights if dims[w.fqn] != w.dim})
        if twice and not block.refused:
            block.refused = f"the expert weight {twice[0]} is multiplied with its experts on two different dims"
        if rows is None and not block.refused:
            block.refused = (f"the grouped matmuls sharing {offsets.name} read different rows: "
                             f"{', '.join(f'{m.name} reads {m.args[0]}{rules.at(m)}' for m in matmuls)}")
        if not offsets:
            block.refused = f"{matmuls[0].name} ({op_name(matmuls[0])}) has no offsets: not a routed-expert matmul"
        elif len(counts) > 1:
            block.refused = f"the grouped matmuls sharing {offsets.name} read weights of {sorted(counts)} experts"
        block.refused = block.refused or _check_chain(block)
        blocks.append(block)
    return blocks


def _check_chain(block: MoEBlock) -> str:
    """Why the block cannot move to the experts' ranks, or '': its rows placed through it by the propagation
    (``ep_walk._Walk``), then its expert weights and biases read by the block alone."""
    walk = ep_walk._Walk(block)
    block.placed = set(walk.shard) | set(walk.items)
    if walk.refused:
        return walk.refused
    path = {node for node, _dim in block.weight_paths}
    for fqn, placeholder in block.weights.items():
        stack = [placeholder]
        while stack:  # the weight, its casts and views: read by each other and by the grouped matmuls alone
            node = stack.pop()
            for user in node.users:
                if user in path:
                    stack.append(user)
                elif not ((user in block.matmuls and user.args[1] is node) or ep_walk.checks_dtype_only(user)):
                    return f"the expert weight {fqn} is also read by {user.name} ({op_name(user)}){rules.at(user)}"
    for fqn, placeholder in block.biases.items():
        for user in placeholder.users:
            if user not in block.gathers:
                return f"the expert bias {fqn} is also read by {user.name} ({op_name(user)}) outside the expert matmuls"
        for gather in block.gathers:
            if gather.args[0] is placeholder and any(u not in block.placed for u in gather.users):
                return f"{gather.name} (the rows of {fqn}) is also read outside the expert matmuls"
    return ""


PICKS = {aten.nonzero.default, aten.argwhere.default, aten.where.default}  # a mask's true entries' indices


def looped_experts(graph: fx.Graph) -> dict:
    """Experts computed one by one in a stage graph: {the list's module (``model.layers.0.mlp.experts``): its
    members' first linear each, by index}, for lists of at least two numbered modules whose linears read rows an
    index picked at a mask's true entries (Mistral's reference MoE, litgpt's ``LLaMAMoE``, transformers' Mixtral
    before grouped matmuls: ``torch.where(mask)``, ``x[token_idx]``, ``y[token_idx] += ...``)."""
    from tracepp.split.plan_cost import _numbered, reached

    picks = [n for n in graph.nodes if n.op == "call_function" and n.target in PICKS and len(n.args) == 1]
    indices = {user for pick in picks for _value, user in reached(pick, 3, lambda u: u.target is operator.getitem
                                                                   or u.target in rules.VIEWS)} | set(picks)
    gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.index.Tensor
               and any(a in indices for a in n.all_input_nodes if a is not n.args[0])]
    lists: dict = {}
    for gather in gathers:
        for _value, user in reached(gather, 4, lambda u: u.target in rules.KEEP or u.target in rules.VIEWS):
            numbered = _numbered(node_modules(user)[-1]) if user.target is aten.linear.default and node_modules(
                user) else []
            if numbered:  # the innermost numbered module holding the linear: a member of its list
                parent, _, index = numbered[-1].rpartition(".")
                lists.setdefault(parent, {}).setdefault(index, user)
    return {parent: members for parent, members in lists.items() if len(members) > 1}


def _looped_experts(graph: fx.Graph):
    """:func:`looped_experts`' first list as a message names it (``'model.layers.0.mlp.experts.* (4 of them, the
    first at model.py:42)'``), or None."""
    for parent, members in looped_experts(graph).items():
        return f"{parent}.* ({len(members)} of them, the first{rules.at(next(iter(members.values())))})"
    return None


def _divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan(graph, ep: int, dp: int, fqn_map) -> tuple:
    """(EPPlan, per stage its blocks) for ``--ep ep`` (``fqn_map(stage, graph)``: placeholder name -> FQN). Raises
    :class:`ExpertParallelError` when ``ep`` > 1 and the model has no routed experts, a block cannot be moved, or
    ``ep`` does not divide an expert count."""
    per_stage = [find_blocks(stage.graph, fqn_map(stage, graph)) for stage in graph.stages]
    result = EPPlan(size=ep)
    blocks = [(index, block) for index, found in enumerate(per_stage) for block in found]
    if ep > 1 and not blocks:
        looped = next(filter(None, (_looped_experts(stage.graph) for stage in graph.stages)), None)
        raise ExpertParallelError(
            f"--ep {ep}: this model has no routed experts (grouped matmuls over an expert dim with per-expert "
            f"offsets: torch._grouped_mm, torch.nn.functional.grouped_mm or transformers' grouped_mm_fallback)"
            + (f"; its experts {looped} are called one by one, each on the rows an index picks, which expert "
               f"parallelism does not move: write them as grouped matmuls over one weight of all experts "
               f"(transformers' grouped_mm experts, torchtitan's GroupedExperts) to shard them over --ep"
               if looped else "") + f"; split without --ep (--dp {dp} alone replicates or shards it)")
    for index, block in blocks:
        if ep > 1 and block.refused:
            raise ExpertParallelError(f"--ep {ep}: the routed experts of {block.name} (stage {index}) cannot be "
                                      f"sharded: {block.refused}. Split without --ep")
        if ep > 1 and block.num_experts % ep:
            works = [k for k in _divisors(block.num_experts) if dp % k == 0]
            raise ExpertParallelError(f"--ep {ep} does not divide the {block.num_experts} routed experts of "
                                      f"{block.name}: use --ep in {works} (dividing both the experts and --dp {dp})")
        rows = _val(block.rows)
        row_bytes = tensor_bytes(rows) // max(int(rows.shape[0]), 1) if isinstance(rows, torch.Tensor) else 0
        out_row = tensor_bytes(_val(block.out)) // max(int(_val(block.out).shape[0]), 1)
        pairs = int(rows.shape[0]) if isinstance(rows, torch.Tensor) else 0
        entry = {"name": block.name, "stage": index, "experts": block.num_experts, "local_experts":
                 block.num_experts // ep if not block.refused else block.num_experts, "pairs": pairs,
                 "weights": sorted(block.weights)}
        if block.biases:
            entry["biases"] = sorted(block.biases)
        if ep > 1:  # per microbatch, forward: rows out and back; on average (ep-1)/ep of them leave the rank
            moved = pairs * (row_bytes + out_row) * (ep - 1) // ep
            entry["all_to_all_bytes"] = {"forward": moved, "backward": moved}
        if block.refused:
            entry["refused"] = block.refused
        result.blocks.append(entry)
        if ep > 1:
            for fqn, placeholder in list(block.weights.items()) + list(block.biases.items()):
                shape, dim = [int(s) for s in _val(placeholder).shape], block.expert_dims.get(fqn, 0)
                local = list(shape)
                local[dim] //= ep
                result.params[fqn] = {"dim": dim, "experts": block.num_experts, "shape": shape, "local": local}
    return result, per_stage


def expert_figures(graph: fx.Graph, fqn_of: dict, flops: dict):
    """``per_segment(nodes)`` for ``split.partition.segment_table``: what ``plan --tune --ep-sizes`` needs of the
    routed experts in one segment of the whole traced graph (before any rewrite, so the same whatever ``--ep`` the
    folder was split with), or {} where the segment has none:

    ``params`` / ``param_bytes``: the routed expert weights (each counted once, in the segment of its block);
    ``flops``: the forward FLOPs of their grouped matmuls for the traced microbatch; ``blocks``: per block its
    ``name``, ``experts``, ``pairs`` (the (token, expert) rows of one microbatch on one rank), ``row_bytes`` (one
    row into the first grouped matmul: what dispatch sends), ``out_row_bytes`` (one row out of the last: what
    combine sends back) and ``refused`` (why ``--ep`` cannot shard it, or ""). From these the tuner prices any ep:
    per microbatch and block, dispatch and combine each move ``pairs x row bytes x (ep - 1) / ep`` out of a rank
    (the manifest's ``all_to_all_bytes`` at the split's ep)."""
    blocks = find_blocks(graph, fqn_of)
    first = {block.matmuls[0]: block for block in blocks}
    seen: set = set()

    def per_segment(nodes: list) -> dict:
        found = [first[node] for node in nodes if node in first]
        if not found:
            return {}
        out = {"params": 0, "param_bytes": 0, "flops": 0, "blocks": []}
        for block in found:
            for fqn, placeholder in sorted(block.weights.items()):
                if fqn not in seen:
                    seen.add(fqn)
                    out["params"] += as_int(_val(placeholder).numel())
                    out["param_bytes"] += held_bytes(placeholder)
            out["flops"] += sum(int(flops.get(m.name, 0)) for m in block.matmuls)
            rows, result = _val(block.rows), _val(block.out)
            pairs = as_int(rows.shape[0]) if isinstance(rows, torch.Tensor) else 0
            out_rows = as_int(result.shape[0]) if isinstance(result, torch.Tensor) else 0
            out["blocks"].append({
                "name": block.name, "experts": block.num_experts, "pairs": pairs,
                "row_bytes": tensor_bytes(rows) // pairs if pairs else 0,
                "out_row_bytes": tensor_bytes(result) // out_rows if out_rows else 0, "refused": block.refused})
        return out

    return per_segment


def apply(graph, ep_plan: EPPlan, per_stage: list) -> None:
    """Rewrite each block: its rows dispatched to the experts' ranks and combined back (``ep`` > 1), or its
    offsets counted for the metrics (``ep`` 1); expert weights annotated with their local shape."""
    ep = ep_plan.size
    for stage, blocks in zip(graph.stages, per_stage):
        g = stage.graph
        for block in blocks:
            _eager_kernel(block)
            if block.refused:
                continue
            if ep > 1:
                _exchange(g, block, ep)
            else:
                _count(g, block)
        g.lint()


def _eager_kernel(block: MoEBlock) -> None:
    """transformers' ``grouped_mm_fallback`` -> ``tracepp.grouped_mm``: transformers calls its per-expert loop
    whenever it is traced in fp32 and ``torch._grouped_mm`` in eager; the op makes eager's choice at run time
    (``runtime/expert_parallel.grouped_mm``), so the rank scripts run the kernel the model runs untraced."""
    for matmul in block.matmuls:
        if op_name(matmul) == "transformers::grouped_mm_fallback":
            matmul.target = torch.ops.tracepp.grouped_mm.default


def _set_offsets(matmul, new) -> None:
    if len(matmul.args) > 2:
        matmul.args = matmul.args[:2] + (new,) + matmul.args[3:]
    else:
        matmul.kwargs = dict(matmul.kwargs, offs=new)


def _count(g: fx.Graph, block: MoEBlock) -> None:
    rows = int(_val(block.rows).shape[0])
    with g.inserting_before(block.matmuls[0]):
        counted = g.call_function(torch.ops.tracepp.moe_tokens.default, (block.offsets, rows, block.name))
    counted.meta.update(_meta(block.matmuls[0]), val=_val(block.offsets))
    for matmul in block.matmuls:
        _set_offsets(matmul, counted)


def _meta(like) -> dict:
    return {k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")}


def _exchange(g: fx.Graph, block: MoEBlock, ep: int) -> None:
    first, last = block.matmuls[0], block.out
    rows_val, offsets_val = _val(block.rows), _val(block.offsets)
    between = block.placed - {block.rows}  # placed by the walk: from the rows' first use to the last matmul
    local = block.num_experts // ep
    with g.inserting_before(first):
        dispatched = g.call_function(torch.ops.tracepp.ep_dispatch.default,
                                     (block.rows, block.offsets, block.num_experts, block.name))
        local_rows = g.call_function(operator.getitem, (dispatched, 0))
        local_offsets = g.call_function(operator.getitem, (dispatched, 1))
        plan_node = g.call_function(operator.getitem, (dispatched, 2))
    plan_val = offsets_val.new_empty((2, ep, local), dtype=torch.int64)
    vals = (rows_val, offsets_val.new_empty((local,)), plan_val)
    for node, val in ((dispatched, vals), (local_rows, vals[0]), (local_offsets, vals[1]), (plan_node, vals[2])):
        node.meta.update(_meta(first), val=val)
    for user in list(block.rows.users):  # every grouped matmul of the block reads the rows received
        if user in between:
            user.replace_input_with(block.rows, local_rows)
    position = {node: index for index, node in enumerate(g.nodes)}
    early = {n for n in between if position[n] < position[dispatched]}  # the rows' casts made before the first
    early |= {u for n in early for u in n.users if ep_walk.checks_dtype_only(u)}  # matmul (x.bfloat16()): after dispatch
    anchor = plan_node
    for node in sorted(early, key=position.get):
        anchor.append(node)
        anchor = node
    if block.gathers:  # expert biases: gathered on the expert's rank by each received row's local expert
        with g.inserting_after(plan_node):
            ids = g.call_function(torch.ops.tracepp.ep_expert_ids.default, (local_offsets, local_rows))
        ids.meta.update(_meta(first), val=offsets_val.new_empty((rows_val.shape[0],), dtype=torch.int64))
        anchor = ids
        for gather in block.gathers:
            with g.inserting_after(anchor):
                local = g.call_function(aten.index.Tensor, (gather.args[0], [ids]))
            val = _val(gather)
            local.meta.update(_meta(gather), val=val)
            for user in list(gather.users):
                user.replace_input_with(gather, local)
            g.erase_node(gather)
            anchor = local
    for fill in block.sentinel_fills:  # the dispatched rows are all routed: nothing to mask
        fill.replace_all_uses_with(fill.args[0])
        g.erase_node(fill)
    for matmul in block.matmuls:
        _set_offsets(matmul, local_offsets)
    users = list(last.users)
    with g.inserting_after(last):
        combined = g.call_function(torch.ops.tracepp.ep_combine.default,
                                   (last, plan_node, int(rows_val.shape[0])))
    combined.meta.update(_meta(last), val=_val(last))
    for user in users:
        user.replace_input_with(last, combined)
    annotated = [(p, block.expert_dims.get(fqn, 0)) for fqn, p in list(block.weights.items()) +
                 list(block.biases.items())]
    for node, dim in annotated + block.weight_paths:  # annotations: this rank's experts
        shape = list(_val(node).shape)
        shape[dim] //= ep
        node.meta["val"] = _val(node).new_empty(shape)

