"""What a tensor-parallel placement costs, so that :mod:`split.tensor_parallel` chooses among valid placements by
cost rather than by how much it shards.

A settled walk (``tensor_parallel._Walk``: each value's placement and the collectives it adds) is priced per
microbatch as two figures:

* **bytes moved**, forward and backward, of the collectives the rewrite adds, as ring collectives move them
  (per rank, up to the common factor ``(tp - 1) / tp``): an all-reduce twice its tensor's bytes, an all-gather
  or a reduce-scatter once. A row-wise linear's output is all-reduced forward (reduce-scattered under sequence
  parallelism, all-gathered back in backward); a sum over a sharded dim is all-reduced; a value gathered whole is
  all-gathered; the gradient of a whole value read by sharded ops (``tp_copy``) is all-reduced backward (but
  for parameters' gradients summed once per step, ``tp_grads``: listed at 0 bytes per microbatch); a whole
  value read at this rank's piece (``tp_scatter``) has its gradient pieces all-gathered.
* **FLOPs left replicated**: the forward FLOPs of the ops every rank computes whole (``split.cost``'s counts);
  each rank repeats ``(tp - 1) / tp`` of them.

:func:`cost` folds the two into bytes: a FLOP left replicated costs ``1 / FLOPS_PER_BYTE`` bytes.
``FLOPS_PER_BYTE`` is what one H100 computes in the time its NVLink moves a byte of an all-reduce (about
990 TFLOP/s bf16 dense against about 450 GB/s of bus bandwidth): for a layer of hidden size ``h`` Megatron's
plan and a plan that keeps the residual stream sharded compute the same matmuls sharded, and the second moves
more bytes; a plan that leaves a matmul whole to save an all-reduce pays for it in FLOPs.

Megatron's plan for a decoder layer (:func:`layer_bytes`) is the reference ``inspect`` prints beside each of a
stage's layers: two all-reduces of ``[b, s, h]`` forward (the attention's and the MLP's row-wise outputs) and
two backward (the gradients of their whole inputs): 8 ``b s h`` elements' bytes as ring collectives move them;
for an MLA layer Megatron-Core's (:func:`_latents`: its down-projections whole, their outputs' gradients all-reduced,
in place of the attention input's where only they read it); with low-rank adapters, PEFT's tensor-parallel LoRA
(:func:`_adapters`: one all-reduce of each adapter's latent).
"""
from __future__ import annotations

import collections
import re
import weakref

import torch

from tracepp.split import decompose, rules, tp_grads
from tracepp.split.cost import node_flops, tensor_bytes
from tracepp.split.naming import starred

aten = torch.ops.aten
FLOPS_PER_BYTE = 2000  # an H100's bf16 dense FLOP/s over its NVLink all-reduce bus bandwidth, rounded down


def _bytes(node) -> int:
    return tensor_bytes(node.meta.get("val"))


def _last_consumer(pairs) -> list:
    """``(consumer, value)`` pairs once per value, in the order the walk met the values, each with its last
    consumer."""
    return list({arg: (consumer, arg) for consumer, arg in pairs}.values())


def values_of(node):
    """A maximum's values: ``max(x, dim)``'s first output, or the op's own."""
    return next((user for user in node.users if user.args[1] == 0), node) if node.target is aten.max.dim else node


def collectives(walk) -> list:
    """Every collective ``walk``'s plan adds to its stage, once: ``(what, the value it moves, the node it belongs to,
    bytes it moves per microbatch forward and backward, ring-weighted, the shape it moves where it is not the
    value's or None)``. The manifest lists them
    (``tensor_parallel``), :func:`cost` prices them and :func:`layer_bytes` sums them per decoder layer."""
    out = [("reduce_scatter" if node in walk.reduce_scatters else "all_reduce", node, node, 2 * _bytes(node))
           for node, role in walk.roles.items()  # gathered back in backward
           if role in ("rowwise", "vocab") and node not in walk.deferred]
    out += [("all_reduce", node, node, 2 * _bytes(node)) for node in walk.late_sums]  # partial sums carried to it
    late = tp_grads.holding(walk)  # values holding partial gradients: no copy (parameters: summed once per step)
    out += [("all_reduce (backward)", walk.forms[node][2], node, 2 * _bytes(walk.forms[node][2]))  # 1/tp of a
            for node in set(walk.deferred) | set(walk.reduce_scatters)  # deferred linear's bias on each rank, or
            if walk.roles.get(node) == "rowwise" and walk.forms[node][2] is not None  # one added to each rank's
            and walk.needs_grad.get(walk.forms[node][2]) and walk.forms[node][2] not in late]  # tokens (sp)
    out += [("all_gather (sequence)", arg, consumer, 2 * _bytes(arg))  # reduce-scattered backward
            for consumer, arg in _last_consumer(walk.sp_gathers)]
    out += [("all_reduce", node, node, 2 * _bytes(node)) for node in walk.sums]
    out += [("all_reduce (max)", values_of(node), node, 2 * _bytes(values_of(node))) for node in walk.maxes]
    out += [("all_gather", arg, consumer if consumer.op != "output" else arg, _bytes(arg))
            for consumer, arg in _last_consumer(walk.gathers)]
    out += [("all_reduce (backward)", arg, consumer, 2 * _bytes(arg))  # the walk's copies, or where tp_grads
            for consumer, arg in _last_consumer(tp_grads.backward_reads(walk))]  # sums a gradient's parts
    held = tp_grads.holding(walk)
    out += [("all_reduce (gradient, once per step)", node, node, 0) for node in walk.graph.nodes  # none per microbatch
            if node.op == "placeholder" and node in held]
    out += [("all_gather (backward)", value, consumer, moved, shape)
            for consumer, value, moved, shape in backward_gathers(walk)]
    for node, (x, _weight, _bias, _out_dim, _segments, _whole) in walk.mixed_linears.items():
        # a fused projection with whole parts: its sharded parts read x through tp_copy
        if walk.needs_grad.get(x):
            out.append(("all_reduce (backward)", x, node, 2 * _bytes(x)))
    return [entry if len(entry) == 5 else (*entry, None) for entry in out]


def backward_gathers(walk) -> list:
    """(reader, value, bytes gathered, the shape gathered where it is not the value's or None) of every all-gather ``walk``'s plan runs backward: the gradient pieces of a
    whole value read at a rank's piece (``tp_scatter``; not one whose gradient is a part tp_grads sums,
    ``tp_piece``), and the gradient rows of a fused projection's sharded parts where its weight is whole
    (``tp_scatter`` of their slices). :func:`collectives` prices them and the tuner's figures count them."""
    parts = tp_grads.piece_reads(walk)  # read at its piece, the gradient a part tp_grads sums: no gather
    out = [(consumer, arg, _bytes(arg), None)  # the gradient pieces of a value read at its piece
           for consumer, arg in _last_consumer((c, a) for c, a, _dim, _groups in walk.scatters
                                               if walk.needs_grad.get(a) and (c, a) not in parts)]
    for node, (_x, weight, bias, out_dim, segments, whole) in walk.mixed_linears.items():
        sharded = sum(int(size) for k, size in enumerate(segments) if k not in whole)
        for param in (weight, bias):
            val = param.meta.get("val") if param is not None else None
            if val is not None and walk.needs_grad.get(param):
                dim = out_dim if param is weight else 0
                shape = [int(s) if k != dim else sharded for k, s in enumerate(val.shape)]
                out.append((node, param, _bytes(param) * sharded // int(val.shape[dim]), shape))
    return out


def _moves(walk):
    """(the node a collective belongs to, bytes it moves per microbatch forward and backward) of ``walk``'s plan."""
    return [(belongs, moved) for _what, _value, belongs, moved, _shape in collectives(walk)]


def moved_bytes(walk) -> int:
    """Bytes per microbatch (forward and backward, ring-weighted) of the collectives ``walk``'s plan adds."""
    return sum(moved for _node, moved in _moves(walk))


_FLOPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> (its node count, node_flops)
_EXPERTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> (its node count, expert weights)
_BLOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> (its node count, {node: its block})


def _once_per_graph(cache, graph, make):
    """``make()`` for a stage graph, made once while the graph keeps its nodes (every trial prices the same
    graphs; a rewrite changes the node count)."""
    count = len(graph.nodes)
    found = cache.get(graph)
    if found is None or found[0] != count:
        found = cache[graph] = (count, make())
    return found[1]


def _graph_flops(graph) -> dict:
    """``split.cost.node_flops`` of a stage graph, counted once per graph."""
    return _once_per_graph(_FLOPS, graph, lambda: node_flops(graph))


def replicated_flops(walk) -> int:
    """Forward FLOPs per microbatch of the ops ``walk``'s plan leaves whole on every rank."""
    flops = _graph_flops(walk.graph)
    return sum(flops.get(node.name, 0) for node in walk.graph.nodes
               if not walk.on_shards(node))


_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # a parameter's outermost numbered module: its repeated block


def block_of(fqn: str):
    """A parameter's repeated block (its outermost numbered module, ``model.layers.3``), or None."""
    found = _BLOCK.match(fqn)
    return found.group(1) if found else None


def _expert_weights(graph, fqn_of: dict) -> set:
    """The routed experts' weights of a stage graph (``expert_parallel.find_blocks``), found once per graph."""
    from tracepp.split.expert_parallel import find_blocks

    return _once_per_graph(_EXPERTS, graph,
                           lambda: {fqn for block in find_blocks(graph, fqn_of) for fqn in block.weights})


def _counts(walk) -> dict:
    """{repeated block (None: the parameters outside any): (its parameters' elements, those ``walk``'s plan
    shards)}, routed experts apart (expert parallelism places them)."""
    apart = _expert_weights(walk.graph, walk.fqn_of)
    counts: dict = {}
    for node in walk.graph.nodes:
        fqn = walk.fqn_of.get(node.name) if node.op == "placeholder" else None
        if fqn is not None and fqn not in apart:
            total, sharded = counts.get(block_of(fqn), (0, 0))
            count = int(node.meta["val"].numel())
            counts[block_of(fqn)] = (
                total + count, sharded + (count if any(dim is not None for dim in walk.uses.get(fqn, ())) else 0))
    return counts


def param_shares(walk) -> dict:
    """{repeated block (``model.layers.3``; None: the parameters outside any): the share of its parameters
    (elements) ``walk``'s plan shards}, routed experts apart (expert parallelism places them)."""
    return {block: sharded / total for block, (total, sharded) in _counts(walk).items() if total}


def whole_share(walk) -> float:
    """The share of the stage's parameters (elements) ``walk``'s plan holds whole on every rank, routed experts
    apart."""
    counts = _counts(walk).values()
    total = sum(total for total, _sharded in counts)
    return (total - sum(sharded for _total, sharded in counts)) / total if total else 0.0


def cost(walks: list) -> float:
    """A settled plan's price in bytes per microbatch: bytes moved plus FLOPs each rank repeats, as bytes. The
    gradients summed once per step (``tp_grads``) are marked first: they cost nothing per microbatch."""
    tp_grads.mark(walks)
    moved = sum(moved_bytes(walk) for walk in walks)
    repeated = sum(replicated_flops(walk) * (walk.tp - 1) / walk.tp for walk in walks)
    return moved + repeated / FLOPS_PER_BYTE


def elementwise_kinds(walks: list, roles: dict) -> dict:
    """{kind: [FQNs]} of the parameters the walks shard outside a linear or an embedding (a norm's weight, a
    per-feature scale: sharded because the value they scale is), grouped by module with layer numbers starred
    (``transformer.h.*.norm_2.weight``). ``roles``: {fqn: role} of the linears and embeddings."""
    kinds: dict = {}
    for walk in walks:
        for fqn, dims in walk.uses.items():
            if fqn in roles or None in dims or fqn in walk.forced:
                continue
            kinds.setdefault(starred(fqn), set()).add(fqn)
    return {kind: sorted(fqns) for kind, fqns in sorted(kinds.items())}


def _numbered(path: str) -> list:
    """The prefixes of a module path that end in an index, outermost first (``model.layers.3`` and
    ``model.layers.3.mlp.experts.5`` of ``model.layers.3.mlp.experts.5.up``): the repeated blocks it may be in."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1) if parts[i - 1].isdigit()]


def _blocks(graph) -> dict:
    """{node: the repeated block (decoder layer) it belongs to} of a stage graph. A block is the outermost numbered
    module on a node's module path (``model.layers.3`` for a node of ``model.layers.3.mlp.experts.5``), named by its
    path even where the model never calls it (hourglass's ``for attn, ff in self.layers``: ``layers.0`` holds
    ``layers.0.0``, the attention, and ``layers.0.1``, the MLP). Where that module holds more than one attention per
    call and numbered modules of one type inside it each hold one (MEGABYTE's ``transformers.0``, a Transformer of
    ``transformers.0.layers.*``, lists never called), those are the blocks; a T5 block's self-attention,
    cross-attention and MLP (``block.0.layer.0`` to ``.2``, each its own type) or experts (no attention) are not."""
    from tracepp.split.partition import module_path

    paths, types, calls = {}, {}, {}
    for node in graph.nodes:
        stack = [(module_path(path), kind, key)
                 for key, (path, kind) in (node.meta.get("nn_module_stack") or {}).items()]
        for path, kind, key in stack:
            types.setdefault(path, kind)
            calls.setdefault(path, set()).add(_call(key))
        if stack:  # every numbered prefix of every module on the stack, outermost first (a module called inside a
            #        block that another module owns is in the block)
            paths[node] = tuple(dict.fromkeys(prefix for path, _kind, _key in stack for prefix in _numbered(path)))
    attentions: dict = {}
    for node, prefixes in paths.items():
        if node.op == "call_function" and node.target in rules.ATTENTION_NORMALIZERS:
            for prefix in prefixes:
                attentions[prefix] = attentions.get(prefix, 0) + 1

    def per_call(prefix) -> float:
        return attentions.get(prefix, 0) / max(1, len(calls.get(prefix, ())))

    numbered = {prefix for prefixes in paths.values() for prefix in prefixes}

    def repeated(prefix) -> bool:  # numbered modules of its type beside it, holding attention too (of no type:
        #                             containers never called; not a wrapper class every entry of a list shares:
        #                             sinkhorn's [PreNorm(attention), PreNorm(feed-forward)] pairs)
        parent, kind = prefix.rpartition(".")[0], types.get(prefix)
        return any(other != prefix and other.rpartition(".")[0] == parent and types.get(other) == kind
                   and attentions.get(other) for other in numbered)

    out, chosen = {}, {}
    for node, prefixes in paths.items():
        if prefixes not in chosen:
            block = prefixes[0] if prefixes else None
            for deeper in prefixes[1:]:
                if per_call(block) <= 1 or not attentions.get(deeper) or not repeated(deeper):
                    break
                block = deeper
            chosen[prefixes] = block
        if chosen[prefixes] is not None:
            out[node] = chosen[prefixes]
    return _alternating(_parallel_lists(out, attentions), attentions)


_MIXERS = rules.ALONG | rules.CONVOLUTIONS | rules.SDPA | rules.ATTENTION_NORMALIZERS  # mix positions or route


def _alternating(blocks: dict, attentions: dict) -> dict:
    """``blocks`` with a list's MLP blocks joined to the attention block before each (x-transformers'
    ``attn_layers.layers``: ``layers.0`` an attention, ``layers.1`` a feed-forward, in turn): a block of linears
    with no attention, convolution, scan or softmax (not a Mamba or recurrent mixer, not a router) right after a
    block holding an attention of the same list joins it. A pad does not keep it apart: a feed-forward with token
    shift (x-transformers' ``shift_tokens``: half its input's channels padded one position on) is one column-wise,
    row-wise region of Megatron's plan like any MLP (its figure had set the attention's bytes against a whole
    layer's: 0.50x)."""
    nodes: dict = {}
    for node, block in blocks.items():
        nodes.setdefault(block, []).append(node)
    joined = {}
    for block, members in nodes.items():
        parent, _, index = block.rpartition(".")
        before = f"{parent}.{int(index) - 1}" if index.isdigit() and int(index) > 0 else None
        if before in nodes and attentions.get(before) and not attentions.get(block) and any(
                n.target is torch.ops.aten.linear.default for n in members) and not any(
                n.op == "call_function" and n.target in _MIXERS for n in members):
            joined[block] = before
    return {node: joined.get(block, block) for node, block in blocks.items()} if joined else blocks


def _parallel_lists(blocks: dict, attentions: dict) -> dict:
    """``blocks`` with each layer held by parallel lists made one (XLM: ``transformer.attentions.i``,
    ``transformer.layer_norm1.i``, ``transformer.ffns.i``, ``transformer.layer_norm2.i``, one module list per part
    of a layer): the i-th block of a list without attention joins the i-th attention block of the list beside it
    (the same parent), named as the attention's, where both lists hold the same indices in the graph and it holds a
    linear (not a list of embeddings or rotary tables that happens to be numbered alike)."""
    parts: dict = {}  # (parent, index) -> {list: block}
    for block in set(blocks.values()):
        parent, _, index = block.rpartition(".")
        parent, _, name = parent.rpartition(".")
        parts.setdefault((parent, index), {})[name] = block
    indices: dict = {}
    for (parent, index), lists in parts.items():
        for name in lists:
            indices.setdefault((parent, name), set()).add(index)
    linear = {block for node, block in blocks.items() if node.op == "call_function"
              and node.target in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default)}
    joined = {}
    for (parent, index), lists in parts.items():
        main = [name for name, block in lists.items() if attentions.get(block)]
        if len(main) != 1:
            continue
        for name, block in lists.items():
            if name != main[0] and not attentions.get(block) and block in linear and (
                    indices[(parent, name)] == indices[(parent, main[0])]):
                joined[block] = lists[main[0]]
    if not joined:
        return blocks
    reads: dict = {}  # block -> the blocks its nodes read, directly or through ops outside every block (a residual
    for node, block in blocks.items():  # add, a dropout)
        todo, seen = list(node.all_input_nodes), set()
        while todo:
            source = todo.pop()
            if source in seen or len(seen) > 16:
                continue
            seen.add(source)
            if source not in blocks:
                todo.extend(source.all_input_nodes)
            elif blocks[source] != block:
                reads.setdefault(block, set()).add(blocks[source])
    for (parent, index), lists in parts.items():  # then that index's parts reading the layer (its norms), not
        main = next((lists[name] for name in lists if attentions.get(lists[name])), None)  # tables numbered alike
        layer = {main} | {block for block in lists.values() if joined.get(block) == main}
        if main is not None and len(layer) > 1:
            joined.update({block: main for block in lists.values()
                           if block not in layer and not attentions.get(block) and reads.get(block, set()) & layer})
    return {node: joined.get(block, block) for node, block in blocks.items()}


def _layer_of(node):
    """The repeated block a node belongs to (:func:`_blocks` of its graph), or None."""
    graph = node.graph
    return _once_per_graph(_BLOCKS, graph, lambda: _blocks(graph)).get(node)


def _products_operands(node) -> list:
    """The operands an attention product multiplies (a key or value read at a rank's heads is one; a bias added to
    the scores, Bloom's ALiBi table in ``baddbmm``, is not)."""
    target = node.target
    if target not in rules.ATTENTION_PRODUCTS:
        return []
    if target is torch.ops.aten.einsum.default:
        return list(node.args[1])
    if target in rules.BADDBMM or target in rules.SDPA:  # (bias, a, b) / (q, k, v): the keys and values
        return list(node.args[1:3])
    return list(node.args[:2])


_THROUGH = 12  # ops from a down-projection to the up-projection that reads its latent, and on to the attention


def reached(start, depth: int, passes):
    """(value, user) for every node ``start``'s value reaches in at most ``depth`` ops, breadth first, each once,
    going on from a user only where ``passes(user)``."""
    frontier, seen = [start], {start}
    for _depth in range(depth):
        after = []
        for value in frontier:
            for user in value.users:
                if user not in seen:
                    seen.add(user)
                    yield value, user
                    if passes(user):
                        after.append(user)
        frontier = after


def _reached(start, inside: set, found) -> object:
    """The first node ``found`` accepts among those ``start``'s value reaches in ``_THROUGH`` ops inside a layer."""
    return next((user for _value, user in reached(start, _THROUGH, inside.__contains__)
                 if user in inside and found(user)), None)


def _latents(walk, nodes: list, inside: set) -> list:
    """A layer's low-rank down-projections feeding its attention (MLA: DeepSeek's ``q_a_proj``, 7168 -> 1536 and
    ``kv_a_proj_with_mqa``, 7168 -> 576): linears whose weight narrows, from whose output a linear that widens is
    reached in the layer, and from that an attention product. Megatron-Core keeps them whole on every rank
    (``linear_q_down_proj``, ``linear_kv_down_proj``): its backward all-reduces their outputs' gradients, where the
    dense reference all-reduces the attention input's. The widening linear reads the latent (normed, or a cut of it:
    no wider than it); a narrow product used as weights (hyper-connections' ``normed @ dynamic_alpha_fn``, 5 mixing
    coefficients of 4 residual streams, the branch's projections reading the mixed stream) is not a latent."""
    from tracepp.split.tp_contract import linear_widths, widens

    def linear(node):  # a linear of a 2-D weight, in ``_linear_form``'s form, or None
        form = walk._linear_form(node) if node.op == "call_function" else None
        return form if form is not None and form[1].meta["val"].dim() == 2 else None

    def widening(width):
        def found(node) -> bool:
            form = linear(node)
            return form is not None and widens(form) and linear_widths(form)[0] <= width
        return found

    out = []
    for node in nodes:
        form = linear(node)
        found = linear_widths(form) if form is not None else None
        if found is None or found[1] >= found[0]:
            continue
        up = _reached(node, inside, widening(found[1]))
        if up is not None and _reached(up, inside, lambda n: n.target in rules.ATTENTION_PRODUCTS) is not None:
            out.append(node)
    return out


def _source(node):
    """``node`` before the ops that pass it on unchanged (casts, dropout)."""
    while node.op == "call_function" and node.target in rules.KEEP and node.args:
        node = node.args[0]
    return node


def _linear_readers(walk, value, inside: set) -> list:
    """The linears of a 2-D weight in the layer reading ``value`` (through casts and dropout), as ``(node, its
    _linear_form)``."""
    out, todo, seen = [], [value], set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user not in inside:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target in rules.KEEP:
                todo.append(user)
                continue
            form = walk._linear_form(user) if user.op == "call_function" else None
            if form is not None and form[1].meta["val"].dim() == 2 and _source(form[0]) is _source(value):
                out.append((user, form))
    return out


def _adapters(walk, nodes: list, inside: set, latents: list) -> list:
    """A layer's low-rank adapters (LoRA: ``base(x) + B(A(x)) * scale``, PEFT's, torchtune's, litgpt's): narrowing
    linears (A, not an MLA latent) read by a widening one (B, through casts, dropout and scalings) whose output is
    added to that of another linear reading the same input (the base). PEFT's tensor-parallel LoRA for Megatron
    (``LoraParallelLinear``) keeps A whole beside a column-parallel base with B column-wise (backward all-reduces the
    latent's gradient), and A row-wise beside a row-parallel one with B whole (forward all-reduces the latent): one
    all-reduce of the latent either way."""
    from tracepp.split.tp_contract import narrows

    out = []
    for node in nodes:
        form = walk._linear_form(node) if node.op == "call_function" and node not in latents else None
        if form is None or form[1].meta["val"].dim() != 2 or not narrows(form):
            continue
        ups = [user for user, up in _linear_readers(walk, node, inside) if not narrows(up)]
        bases = [user for user, base in _linear_readers(walk, form[0], inside) if user is not node]
        if any(_summed_with(up, base) for up in ups for base in bases):
            out.append(node)
    return out


def _mixers(walk, nodes: list, inside: set) -> list:
    """A layer's mixers beside its attention and MLP (Zamba's hybrid layer: the shared attention block, then a Mamba
    mixer): row-wise linears whose input is made, inside the layer and through no linear, by a scan over the
    sequence (a convolution, a cumulative op, a loop over heads: ``split.tp_head_loop``) and by no attention.
    Megatron-Core's Mamba mixer is a column-wise ``in_proj`` and a row-wise ``out_proj``: a region of its own, an
    all-reduce of the layer's ``[b, s, h]`` forward and one backward."""
    out = []
    for node in nodes:
        if walk.roles.get(node) != "rowwise":
            continue
        todo, seen, scans = [walk._linear_form(node)[0]], set(), False
        while todo:
            value = todo.pop()
            if not isinstance(value, torch.fx.Node) or value in seen or value not in inside:
                continue
            seen.add(value)
            if value.op != "call_function" or value.target in _PROJECTIONS or walk._linear_form(value) is not None:
                continue
            if value.target in rules.ATTENTION_NORMALIZERS:
                scans = False
                break
            scans = scans or (value.target in rules.CONVOLUTIONS or value.target in rules.SCANS
                              or value in walk.loop_joins)
            todo.extend(value.all_input_nodes)
        if scans:
            out.append(node)
    return out


def _passed_on(node, steps: int = 3) -> set:
    """``node`` and what it becomes through at most ``steps`` casts or scalings by a number."""
    out, value = {node}, node
    for _ in range(steps):
        users = [u for u in value.users if u.op == "call_function" and (u.target in rules.KEEP or (
            u.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, torch.ops.aten.div.Tensor)
            and len(u.all_input_nodes) == 1))]
        if len(users) != 1:
            break
        value = users[0]
        out.add(value)
    return out


def _summed_with(up, base) -> bool:
    """``up``'s output (scaled, cast) is added to ``base``'s."""
    mine, theirs = _passed_on(up), _passed_on(base)
    return any(user.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
               and set(user.all_input_nodes) & mine and set(user.all_input_nodes) & theirs
               for value in mine for user in value.users)


def _layers(walk) -> dict:
    """{repeated block: its nodes, in graph order} of a stage graph (:func:`_layer_of`)."""
    layers: dict = {}
    for node in walk.graph.nodes:
        layer = _layer_of(node) if node.op == "call_function" else None
        if layer is not None:
            layers.setdefault(layer, []).append(node)
    return layers


def latent_weights(walk) -> set:
    """The FQNs of the weights of every layer's low-rank down-projections feeding its attention (:func:`_latents`),
    and of its adapters reading a whole input (:func:`_adapters` beside a column-wise base: PEFT's LoRA keeps A whole
    there): the down-projections the cost trials try whole, their up-projections column-wise."""
    out = set()
    for nodes in _layers(walk).values():
        inside = set(nodes)
        latents = _latents(walk, nodes, inside)
        for node in latents + [n for n in _adapters(walk, nodes, inside, latents)
                               if walk._linear_form(n)[0] not in walk.shard]:
            out.add(walk._param(walk._linear_form(node)[1]))
    return out


def _call(key: str) -> str:
    """Which call of its module a module-stack key is (export keys a repeated call of one module ``...@1``,
    ``...@2``: HRM applies each of its layers several times a step)."""
    return key.rpartition("@")[2] if "@" in key else ""


def _applications(nodes: list, layer: str) -> int:
    """How many times the stage calls the module ``layer`` (:func:`_call`)."""
    from tracepp.split.partition import module_path

    calls = {_call(key) for node in nodes for key, (path, _type) in (node.meta.get("nn_module_stack") or {}).items()
             if module_path(path) == layer}
    return max(1, len(calls))


def _branch_bytes(walk, nodes: list, leaving) -> int:
    """The bytes of the ``[b, s, h]`` Megatron's plan all-reduces in a layer: the layer's last value, or where that
    is wider than every output of the layer's linears of its width ``h`` (hyper-connections' residual streams,
    ``[4 b, s, h]``, each branch reading a mix of them and adding its ``[b, s, h]`` back), the largest such output:
    the row-wise linears' outputs and the column-wise linears' inputs Megatron's plan sums are the branch's."""
    width = leaving.meta["val"].shape[-1]
    outputs = [_bytes(node) for node in nodes if node.op == "call_function" and walk._linear_form(node) is not None
               and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].shape[-1] == width]
    return min(_bytes(leaving), max(outputs)) if outputs else _bytes(leaving)


def _batched(node) -> bool:
    """An attention product's operands are batched (``[b, heads, s, d]``): not ``x @ (A * E).T``, a product with a
    2-D weight (PEFT's AdaLoRA), whose weight read at a rank's rows is no key/value head."""
    return all(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
               and a.meta["val"].dim() >= 3 for a in _products_operands(node))


def _one_head_broadcast(walk) -> set:
    """Attention with fewer key/value groups than --tp: products reading a whole key or value of one head beside
    queries sharded by heads (recurrentgemma's multi-query attention, ``einsum("b t n h, b s n h -> b n t s")`` with
    ``n`` 1 for the key: broadcast to every head, its projection computed whole; x-transformers' ``one_kv_head``,
    ``einsum("b h i d, b j d -> b h i j")``, a key with no heads dim at all), or an sdpa of fewer key/value heads
    than queries and than --tp (Falcon-7B's multi-query attention, whole on every rank or not)."""
    out = set()
    for node in walk.graph.nodes:
        if node.op != "call_function" or node.target not in rules.ATTENTION_PRODUCTS:
            continue
        if node.target in rules.SDPA:  # [b, heads, s, d]: fewer key/value heads than the queries' and than --tp
            q, k = (a.meta.get("val") for a in node.args[:2])
            if (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() >= 3
                    and rules.ints([q.shape[-3], k.shape[-3]]) and int(k.shape[-3]) < min(int(q.shape[-3]), walk.tp)):
                out.add(node)
            continue
        full = _products_operands(node)
        operands = [a for a in full if isinstance(a, torch.fx.Node)]
        labels = rules.einsum_labels(node) if node.target is torch.ops.aten.einsum.default else None
        sharded = [a for a in operands if a in walk.shard]
        for a in sharded:
            dim = walk.shard[a]
            for b in operands:
                val, ref = b.meta.get("val"), a.meta.get("val")
                if (b in walk.shard or not isinstance(val, torch.Tensor) or not isinstance(ref, torch.Tensor)
                        or walk._param_only(b)):  # a table of weights is no key (CoPE: "b h n d, p d -> b h n p")
                    continue
                if val.dim() == ref.dim() and val.shape[dim] == 1 and ref.shape[dim] != 1:
                    out.add(node)
                elif (labels is not None and dim < ref.dim() - 1
                      and labels[0][full.index(a)][dim] not in labels[0][full.index(b)]):
                    out.add(node)  # no heads at all: x-transformers' one key/value head, "b h i d, b j d -> b h i j"
                    #                (a dim of heads, before the features: not Mega's one head, whose value's
                    #                features are sharded beside whole weights "b i j, b j d -> b i d")
    return out


_SCORES_DEPTH = 10  # ops from an attention product to the softmax that normalizes its scores (scale, bias, mask)


def _attends(node) -> bool:
    """``node`` normalizes attention: an sdpa, or a softmax of scores an attention product makes (a few ops back, a
    scale, a bias or a mask between, no linear): not LIMe's softmax over a linear's per-layer weights
    (x-transformers' ``integrate_layers``), a router's, or any softmax of a projection's output."""
    if node.op != "call_function" or node.target not in rules.ATTENTION_NORMALIZERS:
        return False
    if node.target in rules.SDPA:
        return True
    todo, seen = collections.deque([(node.args[0], 0)]), set()  # breadth first: each value at its nearest depth
    while todo:
        value, depth = todo.popleft()
        if not isinstance(value, torch.fx.Node) or value in seen or depth > _SCORES_DEPTH:
            continue
        seen.add(value)
        if value.op != "call_function" or value.target in _PROJECTIONS:
            continue
        if value.target in rules.ATTENTION_PRODUCTS:
            return True
        todo.extend((a, depth + 1) for a in value.all_input_nodes)
    return False


_PROJECTIONS = {torch.ops.aten.linear.default, torch.ops.aten.addmm.default, torch.ops.aten.embedding.default}


def layer_bytes(walk) -> dict:
    """{layer: (bytes ``walk``'s plan moves in it per microbatch, Megatron's bytes for it or None)} over the stage's
    repeated blocks (:func:`_layer_of`). Megatron's plan applies to a decoder layer (one with an attention,
    :func:`_attends`): its
    attention and MLP each column-wise in, row-wise out, an all-reduce of the layer's ``[b, s, h]`` after each
    forward and one of each region's input gradient backward: 8 ``b s h`` elements as ring collectives move them
    (the layer's ``[b, s, h]``: its last value read after it), for each time the stage calls the layer. Megatron-Core divides the key/value groups among
    the tp ranks, and a Mamba-2 mixer's groups (it asserts ``ngroups % tp_size == 0``): a layer with fewer groups
    than tp (computed whole here: a fused projection's whole parts, a head group, a key/value read at a rank's piece
    by the attention, or a head of one gathered: B and C of one group) has no Megatron plan to compare with; nor has
    a layer whose residual adds are recurrent cells (x-transformers' GRU gate, written out by ``decompose.cell``)."""
    from tracepp.split.tp_contract import narrows

    layers = _layers(walk)
    moved = dict.fromkeys(layers, 0)
    for node, count in _moves(walk):
        layer = _layer_of(node)
        if layer in moved:
            moved[layer] += count
    fewer_groups = set(walk.mixed_linears) | {consumer for consumer, *_rest in walk.head_groups} | {
        consumer for consumer, arg, *_rest in walk.scatters if arg in _products_operands(consumer)
        and _batched(consumer)} | set(
        walk.heads_of_one) | _one_head_broadcast(walk)  # a head of one gathered: a multi-query key, Mamba-2's B and
    #                         C of one group (MLA's rotary key is computed whole, from its whole latent)
    fewer_groups |= {n for n in walk.graph.nodes if decompose.of_cell(n)}
    out = {}
    for layer, nodes in layers.items():
        inside = set(nodes)
        megatron = None
        if any(_attends(n) for n in nodes) and not inside & fewer_groups:
            leaving = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3
                       and n.meta["val"].dtype.is_floating_point and any(u not in inside for u in n.users)]
            if leaving:
                latents = _latents(walk, nodes, inside)
                calls = _applications(nodes, layer)
                megatron = 8 * _branch_bytes(walk, nodes, leaving[-1]) * calls
                # MLA: the latents' gradients are all-reduced, in place of the attention input's where no linear
                # Megatron shards column-wise reads that input: one that does not narrow (DeepSeek-V2-Lite's q_proj
                # beside its key/value latent; a LoRA adapter's base), where the narrow ones (a query latent, DSA's
                # indexer projections) are whole
                megatron += 2 * sum(_bytes(n) for n in latents)
                if latents and not any(user not in latents and not narrows(form) for n in latents
                                       for user, form in _linear_readers(walk, walk._linear_form(n)[0], inside)):
                    megatron -= 2 * _bytes(leaving[-1]) * calls
                megatron += 2 * sum(_bytes(n) for n in _adapters(walk, nodes, inside, latents))
                megatron += 4 * _branch_bytes(walk, nodes, leaving[-1]) * len(_mixers(walk, nodes, inside))
        out[layer] = (moved[layer], megatron)
    return out
