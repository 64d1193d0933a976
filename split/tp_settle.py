"""The tensor-parallel plan's fixed point (``tensor_parallel``'s step two): the stage graphs walked until what the walks
learn (a parameter's one placement over all its uses, fused projections' segments, whole parts, pieces, buffers kept
whole) stops changing, and the trials that keep the cheaper of two valid plans (``plan_cost``)."""
from __future__ import annotations

import fnmatch
import itertools
import operator
import os

import torch

from tracepp.split import decompose, plan_cost, rules
from tracepp.split.naming import starred
from tracepp.split.partition import _gradient_flags
from tracepp.split.rules import at as _at, val as _val
from tracepp.split.tp_contract import linear_widths, widens
from tracepp.split.tp_learn import _learn_local_sources, _learn_pieces, _learn_segments, _learn_whole_parts
from tracepp.split.tp_walk import _Walk

MAX_PASSES = 64  # walks of the stages until the plan settles (a handful in practice; reaching it is a bug)

aten = torch.ops.aten
TP = torch.ops.tracepp


def _regions(walk: _Walk) -> list:
    """Connected groups of sharded values; each with its column-wise linears and whether one ends row-wise."""
    parent: dict = {}

    def find(n):
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    tp_sharded = [node for node in walk.shard if walk.kind.get(node) != "seq"]  # sequence shards join nothing
    gathered = set(walk.gathers)  # a value made whole before an op (a value attention gathers) joins nothing there
    for node in tp_sharded + list(walk.sums) + list(walk.maxes):  # a sum (a maximum) over pieces joins what it reads
        for arg in node.all_input_nodes:
            if arg in walk.shard and walk.kind.get(arg) != "seq" and (node, arg) not in gathered:
                parent[find(node)] = find(arg)
    groups: dict = {}
    for node in tp_sharded:
        groups.setdefault(find(node), set()).add(node)
    for node, role in walk.roles.items():
        if role == "rowwise":
            groups.setdefault(find(walk.forms[node][0]), set()).add(node)
    for node in list(walk.sums) + list(walk.maxes):
        groups.setdefault(find(node), set()).add(node)
    return list(groups.values())


def _narrow_columns(walk: _Walk, closing: set) -> dict:
    """{weight FQN: why} of column-wise linears whose sharded output never reaches a row-wise linear or a sum
    over the pieces and is needed whole before the stage's end: the gather would cost what the shard saves. A
    column-wise linear whose output is gathered only to leave the stage (the head's logits) is kept. Adds to
    ``closing`` the FQNs of the column-wise weights in regions a row-wise linear closes: sharded there to good
    effect. A weight also read by a call whose output is needed whole (litgpt's adapter runs the layer's fused
    ``qkv`` on its learned prompt and views the product in its own layout) keeps its shard (``_settle_on``): that
    call's small output is gathered, where making the weight whole would replicate the attention that shards it."""
    out = {}
    for region in _regions(walk):
        if any(walk.roles.get(n) == "rowwise" for n in region):  # closed: its shards are summed, not gathered
            closing.update(walk._param(walk.forms[n][1]) for n in region if walk.roles.get(n) == "colwise")
            continue
        inside = [consumer for consumer, arg in walk.gathers if arg in region and consumer.op != "output"
                  and arg not in walk.gathered_out]
        if not inside or _gathers_narrower(walk, region, inside):
            continue
        why = f"its output is needed whole by {inside[0].target}{_at(inside[0])}"
        for node in region:
            if walk.roles.get(node) == "colwise":
                out[walk._param(walk.forms[node][1])] = why
    return out


def _gathers_narrower(walk: _Walk, region, inside: list) -> bool:
    """A recurrent cell written out (``decompose.cell``) whose column-wise linears compute at least twice the
    elements its gathers make whole (a GRU gate's two linears of three gates each, gathered once as the new state):
    the shard saves more than the gather moves. (Only there: elsewhere a region gathered before the stage's end is
    replicated as before, its cost not weighed.)"""
    if not any(decompose.of_cell(node) for node in region):
        return False
    computed = [_val(node).numel() for node in region if walk.roles.get(node) == "colwise"]
    gathered = [_val(arg).numel() for consumer, arg in walk.gathers if arg in region and consumer in inside]
    if not computed or not all(isinstance(n, int) for n in computed + gathered):
        return False
    return sum(computed) >= 2 * sum(gathered)


def fqn_map(stage, graph) -> dict:
    """Placeholder node name -> FQN of the stage's parameters (the state placeholders come first, in order)."""
    nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
    return {node.name: graph.state[name].fqn for node, name in zip(nodes, stage.state)
            if graph.state[name].kind == "parameter"}


def grad_flags(stage, graph) -> dict:
    """Which values of a stage graph carry a gradient: downstream of its trainable parameters (a frozen one,
    ``requires_grad=False``, takes none: RoFormer's sinusoidal position table) or of a received value that does
    (placeholders: state, root inputs, received values, in that order)."""
    nodes = [n for n in stage.graph.nodes if n.op == "placeholder"]
    first = len(stage.state) + len(stage.root_inputs)
    received = {nodes[first + i].name for i, (_producer, name) in enumerate(stage.received)
                if graph.values[name].meta.requires_grad}
    frozen = {node.name for node, name in zip(nodes, stage.state) if not graph.state[name].trainable}
    return _gradient_flags(stage.graph, (set(fqn_map(stage, graph)) - frozen) | received)


def _forced_by_overrides(aliases: dict, overrides) -> dict:
    """{fqn: why} of the parameters the model file's ``tp_plan`` replicates; a value it does not know is refused."""
    notes = {}
    for pattern, how in (overrides or {}).items():
        if how not in ("colwise", "rowwise", "replicate"):
            raise ValueError(f"tp_plan[{pattern!r}] = {how!r}: use 'colwise', 'rowwise' or 'replicate'")
        for fqn, names in aliases.items():
            if how == "replicate" and any(fnmatch.fnmatchcase(name, pattern) for name in names):
                notes[fqn] = f"tp_plan {pattern!r}"
    return notes


def _low_rank(walk: _Walk) -> list:
    """The low-rank pairs sharded as such: per region whose column-wise linears narrow (fewer output features
    than input) and whose row-wise linear widens again, ({weight FQN: why} of its column-wise linears, the
    row-wise linears' FQNs). DeepSeek's
    MLA is one (``q_a_proj`` 7168 -> 1536, a norm, ``q_b_proj`` 1536 -> 128 heads): sharded as a pair, the wide
    output comes back whole and the attention that reads it per head runs whole; kept whole instead, the widening
    linear becomes column-wise on the heads it makes, as Megatron-Core shards MLA. A narrow MLP (a shared expert
    of 2048 under a hidden size of 7168) has the same shapes and is better sharded as a pair: :func:`settle`
    measures which."""
    def features(node):
        return linear_widths(walk.forms[node]) or (0, 0)  # (in, out); symbolic: neither narrows nor widens

    out = []
    order = {node: index for index, node in enumerate(walk.graph.nodes)}
    for region in _regions(walk):
        cols = [n for n in region if walk.roles.get(n) == "colwise"]
        rows = sorted((n for n in region if walk.roles.get(n) == "rowwise"), key=order.get)  # the note names the
        #                                                                       first (a region is a set)
        if not cols or not rows:
            continue
        if (all(features(n)[1] < features(n)[0] for n in cols) and all(features(n)[1] >= features(n)[0] for n in rows)
                and any(features(n)[1] > features(n)[0] for n in rows)):  # no reader narrows again, one widens
            up = walk._param(walk.forms[rows[0]][1])
            ups = {walk._param(walk.forms[n][1]) for n in rows}
            found = {}
            for node in sorted(cols, key=lambda n: n.name):
                inp, outp = features(node)
                found[walk._param(walk.forms[node][1])] = (
                    f"a low-rank down-projection ({inp} -> {outp} features) before {up} widens again: column-wise, "
                    f"its {outp} output features all-gathered, so that {up} shards the heads it makes")
            out.append((found, ups))
    return out


_THROUGH_WHOLE = 12  # ops from a whole down-projection to the up-projection that reads its latent, at most
_WHOLE_PATH = (rules.SPLITS | rules.SLICES | set(rules.NORMS) | rules.UNARY | rules.BINARY | rules.VIEWS
               | rules.REDUCTIONS_BY_DIM)  # what may come between them (cuts, norms, casts, elementwise ops, views)


def _whole_low_rank(walk: _Walk, forced: dict) -> list:
    """Low-rank pairs whose down-projection the plan keeps whole because its output is needed whole (by a norm
    over the latent that has no rule for partial sums: torchtitan's MLA, ``kv_norm`` an ``F.rms_norm`` of
    ``wkv_a(x)``'s latent), in :func:`_low_rank`'s form: a linear of a 2-D weight that narrows, replicated by
    the plan (not by the model file's ``tp_plan``: ``forced``), whose output reaches, through whole values
    (cuts, casts, norms, elementwise ops and views), the input of a column-wise linear that widens. Gathered, it
    is column-wise with its latent all-gathered right after it, as :func:`settle` tries for the others."""
    out = []
    for node in walk.graph.nodes:
        form = walk._linear_form(node) if node.op == "call_function" else None
        if form is None or node in walk.roles or node in walk.shard or _val(form[1]).dim() != 2:
            continue
        fqn, widths = walk._param(form[1]), linear_widths(form)
        if fqn is None or fqn in forced or widths is None or widths[1] % walk.tp or widths[1] >= widths[0]:
            continue
        inp, outp = widths
        ups = set()
        for value, user in plan_cost.reached(node, _THROUGH_WHOLE, lambda user: user not in walk.shard and (
                user.target in _WHOLE_PATH or user.target is operator.getitem) and walk.roles.get(user) != "colwise"):
            up = walk._linear_form(user) if walk.roles.get(user) == "colwise" else None
            if up is not None and up[0] is value and widens(up):
                ups.add(walk._param(up[1]))
        if ups:
            up = sorted(ups)[0]
            out.append(({fqn: f"a low-rank down-projection ({inp} -> {outp} features) before {up} widens again: "
                               f"column-wise, its {outp} output features all-gathered, so that {up} shards the heads "
                               f"it makes"}, ups))
    return out


def settle(graphs: list, tp: int, notes: dict, fused: dict = None, sequence=None, mixed: dict = None,
           gathered: dict = None, begins: dict = None) -> tuple:
    """:func:`_settle`, then, where it sharded low-rank pairs (:func:`_low_rank`), the same with the
    down-projections of one kind of pair gathered (the same module in every layer: ``*.self_attn.q_a_proj``):
    column-wise, with their narrow output (the latent) all-gathered, so that the norm after them and the
    up-projection read it whole; kind by kind. A change is kept where every up-projection of the kind then shards
    the heads it makes (column-wise to the end of its region): the attention that reads them runs on shards, and
    the all-reduce of the wide output is gone. (Megatron-Core keeps MLA's down-projections whole on every rank;
    gathered, each rank holds 1/tp of them and computes 1/tp of their product, for one all-gather of the latent.)
    A narrow MLP (a shared expert under a larger hidden size) has the same shapes, but its up-projection's output
    is needed whole by the residual add: it stays a row-wise pair. ``notes``, ``fused``, ``mixed`` and
    ``gathered`` (fqn -> why) end as the kept plan's."""
    from tracepp.split import blocks

    with blocks.remembered():  # every trial settles the same graphs: folded and compared once
        return _settle_trials(graphs, tp, notes, fused, sequence, mixed, gathered, begins)


def _settle_trials(graphs: list, tp: int, notes: dict, fused: dict, sequence, mixed: dict, gathered: dict,
                   begins: dict) -> tuple:
    fused = {} if fused is None else fused
    mixed = {} if mixed is None else mixed
    start = _copied((notes, fused, mixed))
    best = _settle(graphs, tp, notes, fused, sequence, mixed, begins=begins)
    price = None  # the kept plan's, priced once when a trial first needs it (each trial prices only itself)
    kept, tried = {}, set()
    every: dict = {}  # every kind of pair met: starred down-projection FQNs -> ({down fqn: why}, {up fqns})
    while True:  # a kept kind can turn other layers' pairs into low-rank ones (DeepSeek-V3.2): found, tried again
        kinds: dict = {}  # the pair's modules with layer numbers starred -> ({down fqn: why}, {up fqns})
        for walk in best[0]:  # sharded as pairs, or whole where the latent is needed whole (torchtitan's MLA)
            for downs, ups in _low_rank(walk) + _whole_low_rank(walk, start[0]):
                key = tuple(starred(fqn) for fqn in downs)
                entry = kinds.setdefault(key, ({}, set()))
                entry[0].update({f: w for f, w in downs.items() if f not in start[0] and f not in tried})
                entry[1].update(ups)
                known = every.setdefault(key, ({}, set()))
                known[0].update(downs)
                known[1].update(ups)
        pending = [(downs, ups) for downs, ups in kinds.values() if downs]
        if not pending:
            break
        if len(pending) > 1:  # every kind at once first (MLA's q and kv pairs: each alone leaves the attention whole)
            pending.insert(0, ({f: w for downs, _ups in pending for f, w in downs.items()},
                               {f for _downs, ups in pending for f in ups}))
        for downs, ups in pending:
            if set(downs) <= set(kept):
                continue
            tried.update(downs)
            trial = _copied(start)
            marked = dict(kept, **downs)  # folded blocks' copies join it (a left-out block gathered as its b3)
            found = _settle(graphs, tp, *trial[:2], sequence, trial[2], marked, begins=begins)
            roles, ending = _linear_roles(found[0]), {}  # and whether an up-projection's region ends reduced
            for walk in found[0]:
                for region in _regions(walk):
                    reduced = any(walk.roles.get(n) == "rowwise" or n in walk.sums for n in region)
                    for n in region:
                        if walk.roles.get(n) == "colwise":
                            ending[walk._param(walk.forms[n][1])] = reduced
            # kept where each up-projection shards what it makes to a row-wise linear (the heads, to the output
            # projection) or a sum over its pieces (DeepSeek-V3.2's indexer: the heads' scores weighted and
            # summed), not only to be gathered again (a narrow MLP's down-projection before a residual add)
            # and where the plan then meets no more ops that need a sharded value whole (a norm's modulation MLP,
            # 64 -> 16 -> 64, has the shapes of a pair, but gathered it shards the residual stream it scales, up to
            # the router and the experts that need it whole: AXK2)
            # and where it costs less, or where the plan before it holds more of a layer whole than the budget
            # allows against it (torchtitan's MLA: its latent needed whole, 9% of each layer whole; gathered, a
            # latent all-gather more): a standard attention whose heads are narrower than the hidden size (Gemma's
            # 8 x 256 under 2,304) has the shapes of a pair, and gathered it moved 3.9x Megatron's bytes
            if not (all(roles.get(fqn) == "colwise" and ending.get(fqn) and fqn not in trial[0] for fqn in ups)
                    and refusals(found) <= refusals(best)):
                continue
            price = plan_cost.cost(best[0]) if price is None else price
            found_price = plan_cost.cost(found[0])
            if found_price < price or not within_budget([plan_cost.param_shares(w) for w in found[0]],
                                                        [plan_cost.param_shares(w) for w in best[0]]):
                best, kept, price = found, marked, found_price
                for mine, theirs in zip((notes, fused, mixed), trial):
                    mine.clear()
                    mine.update(theirs)
    best, kept = _duplicated_where_cheaper(graphs, tp, (notes, fused, mixed), sequence, begins, start, kept, best,
                                           every)
    best = _whole_where_cheaper(graphs, tp, (notes, fused, mixed), sequence, begins, start, kept, best)
    best = _spread_whole_where_cheaper(graphs, tp, (notes, fused, mixed), sequence, begins, start, kept, best)
    if gathered is not None:  # those the kept plan made column-wise (an input sharded by then: row-wise)
        roles = _linear_roles(best[0])
        gathered.update({fqn: why for fqn, why in kept.items() if roles.get(fqn) == "colwise"})
    return best


SHARE_FLOOR = 0.95  # a trial that makes parameters whole keeps a block's sharded share of parameters at least this
WHOLE_BUDGET = 0.05  # ... and adds at most this share of a block's parameters to what every rank holds whole


def within_budget(before: list, after: list) -> bool:
    """Whether a plan whose stages shard ``after`` of their parameters may replace one that shards ``before`` (per
    stage, ``plan_cost.param_shares``: {repeated block: share}): parameters made whole cost memory on every rank,
    so a cheaper plan buys its bytes with at most ``WHOLE_BUDGET`` of a block's parameters, and never takes a block
    (a decoder layer; or the parameters outside any) that shards ``SHARE_FLOOR`` of them below it."""
    return not _over_budget(before, after)


def _over_budget(before: list, after: list) -> set:
    """The blocks :func:`within_budget` refuses."""
    return {block for stage_before, a in zip(before, after) for block, b in stage_before.items()
            if not (a.get(block, 0.0) >= b - WHOLE_BUDGET and (b < SHARE_FLOOR or a.get(block, 0.0) >= SHARE_FLOOR))}


def _added(before: list, after: list) -> float:
    """The largest share of a block's parameters ``after`` holds whole where ``before`` shards them."""
    return max((b - a.get(block, 0.0) for stage_before, a in zip(before, after) for block, b in stage_before.items()),
               default=0.0)


def _duplicated_where_cheaper(graphs: list, tp: int, learned: tuple, sequence, begins: dict, start: tuple,
                              kept: dict, best: tuple, every: dict) -> tuple:
    """(plan, gathered marks): the settled plan ``best``, or a cheaper one with low-rank pairs whole on every rank.
    First the down-projections alone, as Megatron-Core duplicates MLA's ``linear_q_down_proj`` and
    ``linear_kv_down_proj``: the latent is computed whole, each up-projection column-wise on the heads it makes, and
    backward all-reduces the latents' gradients where the gathered plan all-gathers the latents forward and
    all-reduces the layer input's gradient backward (kept only where every up-projection is then column-wise).
    Every latent of a layer at once (one alone is neither Megatron-Core's plan nor the gathered one).
    Then, for the other kinds, the whole pair: a narrow gate on the residual stream (Gemma 4's per-layer
    input gate, 2,304 -> 256 -> 2,304) sharded as a column/row pair all-reduces its output forward and its input's
    gradient backward, as much as an MLP does, for a few FLOPs. Each costs its FLOPs on every rank and its
    parameters whole (:func:`within_budget`). Every such kind at once first, then kind by kind; a trial is kept where
    the plan costs less (``split.plan_cost``), meets no more ops that need a sharded value whole and is within the
    budget (else the layers within it are tried alone)."""
    kinds = [(downs, ups) for downs, ups in every.values()
             if downs and not any(fqn in start[0] for fqn in downs)]  # not made whole by the model file
    if not kinds:
        return best, kept
    latents = set().union(*(plan_cost.latent_weights(walk) for walk in best[0]))
    mla = [(downs, ups) for downs, ups in kinds if set(downs) <= latents]  # down-projections feeding the attention
    pairs = [(downs, ups) for downs, ups in kinds if not set(downs) <= latents]

    def together(found: list) -> list:
        return [({f: w for downs, _ups in found for f, w in downs.items()}, {f for _downs, ups in found for f in ups})]

    # Megatron-Core's plan keeps every latent of a layer whole (one of them alone is neither plan); other pairs
    # every kind at once, then kind by kind
    trials = ([("latent", *group) for group in together(mla)] if mla else []) + [
        ("pair", *group) for group in (together(pairs) if len(pairs) > 1 else []) + pairs]
    price = plan_cost.cost(best[0])
    shares = [plan_cost.param_shares(walk) for walk in best[0]]
    feeds = {fqn: max(sorted(ups), key=lambda up, fqn=fqn: len(os.path.commonprefix([up, fqn])))
             for downs, ups in kinds for fqn in downs}  # a down-projection's up-projection (in its own layer)
    made: set = set()
    whys: dict = {}
    while trials:
        mode, downs, ups = trials.pop(0)
        downs = {fqn: why for fqn, why in downs.items() if fqn not in made}  # those not made whole by a kept trial
        ups = {fqn for fqn in ups if fqn not in made}
        wanted = set(downs) | (set(ups) if mode == "pair" else set())
        if not downs:
            continue
        trial = _copied(start)
        trial[0].update(dict.fromkeys(wanted | made, ""))
        trial[0].update(whys)
        marked = {fqn: why for fqn, why in kept.items() if fqn not in wanted | made}
        found = _settle(graphs, tp, *trial[:2], sequence, trial[2], marked, begins=begins)
        roles = _linear_roles(found[0])
        if mode == "latent" and not all(roles.get(fqn) == "colwise" for fqn in ups):
            continue
        if refusals(found) > refusals(best):
            continue
        found_price, found_shares = plan_cost.cost(found[0]), [plan_cost.param_shares(w) for w in found[0]]
        if found_price >= price:
            continue
        if not within_budget(shares, found_shares):  # the layers within budget alone (the dense ones of an MoE)
            over = _over_budget(shares, found_shares)
            fewer = {fqn: why for fqn, why in downs.items() if plan_cost.block_of(fqn) not in over}
            if fewer and len(fewer) < len(downs):
                trials.insert(0, (mode, fewer, {fqn for fqn in ups if plan_cost.block_of(fqn) not in over}))
            continue
        cost = (f"the plan cost {price:,.0f} bytes per microbatch with it sharded, {found_price:,.0f} whole "
                f"(split/plan_cost.py), for {_added(shares, found_shares):.1%} of a layer's parameters held whole")
        for fqn in sorted(wanted):
            if mode == "latent":
                whys[fqn] = (f"a low-rank down-projection kept whole on every rank (Megatron-Core's MLA plan), so "
                             f"that {feeds.get(fqn, sorted(ups)[0])} shards the heads it makes from a whole latent: "
                             f"{cost}")
            else:
                whys[fqn] = (f"a low-rank pair kept whole on every rank: as a column/row pair it all-reduced its "
                             f"output forward and its input's gradient backward; {cost}")
        trial[0].update(whys)
        best, price, shares, kept, made = found, found_price, found_shares, marked, made | wanted
        for mine, theirs in zip(learned, trial):
            mine.clear()
            mine.update(theirs)
    return best, kept


def _spreading(walks: list) -> dict:
    """{FQN: why} of the column-wise linears whose sharded output reaches more than one row-wise linear: not one
    column/row pair but a value several regions read sharded (RemBERT's ``embedding_hidden_mapping_in``, 256 ->
    1,152, read by the first layer's q, k and v projections: each all-reduces its output where Megatron's plan
    all-reduces once)."""
    readers: dict = {}
    for walk in walks:
        for node, role in walk.roles.items():
            if role != "rowwise" or node not in walk.forms:
                continue
            for fqn in walk.origin.get(walk.forms[node][0], ()):
                readers.setdefault(fqn, set()).add(walk._param(walk.forms[node][1]))
    return {fqn: f"its sharded output is read by {len(found)} row-wise linears ({', '.join(sorted(found)[:3])}"
                 f"{', ...' if len(found) > 3 else ''})"
            for fqn, found in readers.items() if len(found) > 1 and fqn is not None}


def _unclosed(walks: list) -> dict:
    """{FQN: why} of the column-wise linears whose sharded output no row-wise linear reads and an op inside the stage
    gathers (a router's scores over 2 experts sharded by expert, read by top-k: colt5-attention's routing tokens):
    a region Megatron's plan never opens. Followed from the linear through the values it shards, to the first
    row-wise linear or gather (a head whose output leaves the stage is not one)."""
    found: dict = {}
    for walk in walks:
        gathered = {value for user, value in walk.gathers if user.op != "output"}
        for node, role in walk.roles.items():
            fqn = walk._param(walk.forms[node][1]) if role == "colwise" and node in walk.forms else None
            if fqn is None or fqn in found or node in walk.gathered_out:  # (a low-rank down-projection's narrow
                continue                                                    # output: gathered by design, by cost)
            todo, seen, closed, inside = [node], {node}, False, False
            while todo and not closed:
                value = todo.pop()
                inside |= value in gathered
                for user in value.users:
                    if walk.roles.get(user) == "rowwise":
                        closed = True
                    elif (user in walk.shard or user in walk.items) and user not in seen:  # (top-k's items too)
                        seen.add(user)
                        todo.append(user)
            if inside and not closed:
                found[fqn] = "its sharded output is gathered inside the stage, read by no row-wise linear"
    return found


def data_free(walks: list) -> dict:
    """{FQN: why} of the column-wise linears whose input no input of the stage reaches: computed from parameters and
    positions alone (x-transformers' dynamic position bias, an MLP over the relative distances -7..7 whose output
    is one bias per head; DeBERTa's projections of its relative position embeddings)."""
    found = {}
    for walk in walks:
        data: set = set()
        for node in walk.graph.nodes:
            if (node.op == "placeholder" and node.name not in walk.fqn_of) or any(
                    a in data for a in node.all_input_nodes):
                data.add(node)
        for node, role in walk.roles.items():
            fqn = walk._param(walk.forms[node][1]) if role == "colwise" and node in walk.forms else None
            if fqn is not None and walk.forms[node][0] not in data:
                found[fqn] = "computed from parameters and positions alone, not from any input of the stage"
    return found


def data_free_whole_where_cheaper(found: tuple, settle_with, whole: dict) -> tuple:
    """``found`` (``settle``'s answer), or the plan with the column-wise linears computed from parameters and
    positions alone (:func:`data_free`) whole on every rank where it costs less (``plan_cost.cost``) and holds
    at most :data:`WHOLE_BUDGET` more of each stage's parameters whole. Such a region's FLOPs and its
    collectives' bytes grow alike with the sequence (x-transformers' dynamic position bias: an MLP over the
    relative distances, 16 wide, whose layer norms and second linear each all-reduced ``[2 s - 1, 16]`` forward and
    backward to save a few thousand FLOPs), so the traced sizes price them as the real ones do. Tried by
    ``tensor_parallel.plan`` after the norms are written out (``tensor_parallel.written_out``), on the graphs kept:
    parameters outside any decoder layer are no repeated block's share. ``settle_with(wanted)`` settles with
    ``wanted`` ({fqn: why}) whole too; ``whole`` is what it settles with, emptied where the trial is not kept."""
    candidates = data_free(found[0])
    if not candidates:
        return found
    price = plan_cost.cost(found[0])
    trial = settle_with(candidates)
    trial_price = plan_cost.cost(trial[0])
    if trial_price < price and refusals(trial) <= refusals(found) and all(
            plan_cost.whole_share(after) - plan_cost.whole_share(before) <= WHOLE_BUDGET
            for before, after in zip(found[0], trial[0])):
        why = {fqn: f"computed whole on every rank: {reason}; the plan cost {price:,.0f} bytes per microbatch with "
                    f"it column-wise, {trial_price:,.0f} whole (split/plan_cost.py)"
               for fqn, reason in candidates.items()}
        whole.update(why)
        trial[3].update(why)
        return trial
    whole.clear()
    return found


def _spread_whole_where_cheaper(graphs: list, tp: int, learned: tuple, sequence, begins: dict, start: tuple,
                                kept: dict, best: tuple) -> tuple:
    """The settled plan ``best``, or a cheaper one with column-wise linears :func:`_spreading` or :func:`_unclosed`
    finds computed whole on every rank (their readers then column-wise on a whole input, as Megatron's plan has each
    region begin).
    Every one at once first, then kind by kind (the module with layer numbers starred, ``_KIND_TRIALS`` at most); a
    trial is kept where the plan costs less (``split.plan_cost``: the FLOPs made replicated are priced), meets no
    more ops that need a sharded value whole and is within the budget of parameters held whole
    (:func:`within_budget`)."""
    spreading = {fqn: why for fqn, why in {**_unclosed(best[0]), **_spreading(best[0])}.items()
                 if fqn not in start[0]}
    if not spreading:
        return best
    price = plan_cost.cost(best[0])
    shares = [plan_cost.param_shares(walk) for walk in best[0]]
    kinds: dict = {}  # the module with layer numbers starred -> its linears: one trial per kind, not per layer
    for fqn, why in spreading.items():
        kinds.setdefault(starred(fqn), {})[fqn] = why
    trials = [dict(spreading)] + (list(kinds.values())[:_KIND_TRIALS] if len(kinds) > 1 else [])
    made: dict = {}
    for wanted in trials:
        if set(wanted) <= set(made):
            continue
        trial = _copied(start)
        trial[0].update(dict(made, **dict.fromkeys(wanted, "")))
        found = _settle(graphs, tp, *trial[:2], sequence, trial[2], dict(kept), begins=begins)
        if refusals(found) > refusals(best):
            continue
        found_price, found_shares = plan_cost.cost(found[0]), [plan_cost.param_shares(w) for w in found[0]]
        if found_price >= price or not within_budget(shares, found_shares):
            continue
        cost = (f"the plan cost {price:,.0f} bytes per microbatch with it column-wise, {found_price:,.0f} whole "
                f"(split/plan_cost.py), for {_added(shares, found_shares):.1%} of a layer's parameters held whole")
        made.update({fqn: f"computed whole on every rank: {why}; {cost}" for fqn, why in wanted.items()})
        trial[0].update(made)
        best, price, shares = found, found_price, found_shares
        for mine, theirs in zip(learned, trial):
            mine.clear()
            mine.update(theirs)
    return best


def _copied(learned: tuple) -> tuple:
    """A copy of what a settle learns and updates in place (notes, fused segments, mixed parts), for a trial."""
    notes, fused, mixed = learned
    return dict(notes), dict(fused), {k: set(v) for k, v in mixed.items()}


_KIND_TRIALS = 8  # kinds of elementwise-sharded parameters tried whole one by one, at most


def _whole_where_cheaper(graphs: list, tp: int, learned: tuple, sequence, begins: dict, start: tuple, kept: dict,
                         best: tuple) -> tuple:
    """The settled plan ``best``, or a cheaper one (``split.plan_cost``: bytes moved plus FLOPs left replicated)
    with parameters it shards outside any linear kept whole. A norm's weight is sharded wherever the value it
    scales is; a walk that meets the residual stream whole beside it can shard the stream instead, and then every
    linear that reads it goes row-wise: an all-reduce of each wide MLP input where Megatron all-reduces one
    ``[b, s, h]`` (litgpt's RMSNorm, ``x * weight.float()``). Every such kind (the module with layer numbers
    starred) whole at once first, then kind by kind (``_KIND_TRIALS`` at most); a trial is kept where it costs
    less. ``learned`` (notes, fused, mixed) end as the kept plan's; each kept parameter's note says what it saved."""
    kinds = plan_cost.elementwise_kinds(best[0], _param_roles(best[0]))
    if not kinds:
        return best
    price = plan_cost.cost(best[0])
    trials = [list(kinds)] + ([[kind] for kind in kinds][:_KIND_TRIALS] if len(kinds) > 1 else [])
    chosen: dict = {}
    for trial_kinds in trials:
        if all(kind in chosen for kind in trial_kinds):
            continue
        wanted = dict(chosen, **{kind: kinds[kind] for kind in trial_kinds})
        forced = {fqn: "" for fqns in wanted.values() for fqn in fqns}
        trial = _copied(start)
        trial[0].update(forced)
        found = _settle(graphs, tp, *trial[:2], sequence, trial[2], dict(kept), begins=begins)
        found_price = plan_cost.cost(found[0])
        if found_price >= price:
            continue
        why = (f"kept whole: sharded with the value it scales, the plan cost {price:,.0f} bytes per microbatch "
               f"(collectives, and FLOPs left replicated as bytes: split/plan_cost.py); whole, {found_price:,.0f}")
        trial[0].update({fqn: why for fqn in forced})
        best, price, chosen = found, found_price, wanted
        for mine, theirs in zip(learned, trial):
            mine.clear()
            mine.update(theirs)
        if len(wanted) == len(kinds):
            break
    return best


def _param_roles(walks: list) -> dict:
    """{FQN: "colwise" | "rowwise" | "vocab"} of the weights (and column-wise biases) of the linears and embeddings
    the walks placed."""
    roles: dict = {}
    for walk in walks:
        for node in walk.bags:
            roles[walk._param(node.args[0])] = "vocab"
        for node, role in walk.roles.items():
            weight = node.args[0] if role == "vocab" else walk.forms[node][1]
            roles[walk._param(weight)] = role
            bias = walk.forms[node][2] if role == "colwise" else None
            if bias is not None:
                roles.setdefault(walk._param(bias), "colwise")
    return roles


def _linear_roles(walks: list) -> dict:
    """{weight FQN: "colwise" | "rowwise"} of the linears the walks placed."""
    return {walk._param(walk.forms[n][1]): r for walk in walks for n, r in walk.roles.items() if n in walk.forms}


def refusals(settled: tuple) -> int:
    """How many ops of a settled plan's final walks (:func:`_settle`'s answer) need a sharded value whole."""
    return sum(len(walk.reasons) for walk in settled[0])


def _settle(graphs: list, tp: int, notes: dict, fused: dict = None, sequence=None, mixed: dict = None,
            gathered: dict = None, begins: dict = None) -> tuple:
    """:func:`_settle_on` over the graphs with their runs of repeated blocks folded (``split.blocks``: each
    distinct block walked once; ``begins``: segment index -> the module it begins at), the walks mapped back onto
    every block; unfolded where a graph has no run, or where a run's middle is not decided as its second block."""
    from tracepp.split import blocks

    foldings = [blocks.fold(g, fqn_of, begins) if begins else None for g, fqn_of, *_rest in graphs]
    if not any(foldings):
        return _settle_on(graphs, tp, notes, fused, sequence, mixed, gathered)
    start = (dict(notes), dict(fused or {}), {k: set(v) for k, v in (mixed or {}).items()},
             dict(gathered or {}) if gathered is not None else None)
    folded_graphs = []
    for (g, fqn_of, needs_grad, *rest), folding in zip(graphs, foldings):
        if folding is None:
            folded_graphs.append((g, fqn_of, needs_grad, *rest))
            continue
        into = {original: new for new, original in folding.back.items()}
        flags = {into[node]: flag for node, flag in needs_grad.items() if node in into}
        folded_graphs.append((folding.graph, fqn_of, flags, *rest))
    walks, uses, reasons = _settle_on(folded_graphs, tp, notes, fused, sequence, mixed, gathered)
    if not all(folding is None or blocks.steady(folding, walk.shard, walk.kind, walk.segs, walk.roles)
               for walk, folding in zip(walks, foldings)):  # not a steady state: walk every block
        for mine, old in zip((notes, fused, mixed, gathered), start):
            if mine is not None:
                mine.clear()
                mine.update(old)
        return _settle_on(graphs, tp, notes, fused, sequence, mixed, gathered)
    out_walks, out_reasons = [], []
    for walk, seen, folding, (g, fqn_of, needs_grad, *_rest) in zip(walks, reasons, foldings, graphs):
        if folding is None:
            out_walks.append(walk)
            out_reasons.append(seen)
            continue
        out_walks.append(blocks.expand_object(walk, folding, {"graph": g, "fqn_of": fqn_of,
                                                                "needs_grad": needs_grad}))
        out_reasons.append(dict.fromkeys(blocks.expand_texts(list(seen), folding)))
        for learned in (notes, fused, mixed, gathered):
            if learned is not None:
                learned.update(blocks.expand_keys(learned, folding))
    uses = {}
    for walk in out_walks:
        for fqn, dims in walk.uses.items():
            uses.setdefault(fqn, set()).update(dims)
    return out_walks, uses, out_reasons


def _settle_on(graphs: list, tp: int, notes: dict, fused: dict = None, sequence=None, mixed: dict = None,
               gathered: dict = None) -> tuple:
    """Walk ``graphs`` ([(fx graph, placeholder -> FQN, node -> needs a gradient[, boundary])], stages in order;
    ``boundary``: {"outputs": value names in output order, "received": {placeholder: value name}, "last": bool})
    until every parameter has one placement: learn the segments of fused projections from the cuts of their
    outputs, replicate the parameters whose uses disagree and the column-wise linears whose output is gathered
    before the stage's end, and walk again. With ``sequence`` (the traced sequence length: sequence
    parallelism) a stage's sequence-sharded outputs arrive as sequence shards on the stages that read them.
    Returns (walks, {fqn: set of dims}, per graph the reasons met); ``notes`` (fqn -> why replicated; the forced
    set), ``fused`` (fqn -> segments) and ``mixed`` (fqn -> the parts of a fused projection computed whole: key/value
    parts with fewer heads than tp, learned where a part is needed whole) are updated."""
    fused = {} if fused is None else fused
    mixed = {} if mixed is None else mixed
    reasons = [{} for _ in graphs]  # per graph, every reason met in a pass that decided something, in order
    buffers = [{} for _ in graphs]  # per graph, values written in place where a shard cannot be: kept whole
    sources = [{} for _ in graphs]  # per graph, expands and repeats made on this rank's piece (_learn_local_sources)
    pieces: dict = {}  # fqn -> dim or (dim, segments): parameters whose values are read at their piece, sharded
    #                    where they are made
    from tracepp.split import blocks

    # a stage graph of the same structure as the one before it (a pipeline's middle) is walked once: its walk is
    # the one before, mapped, where it receives the same and learned the same of its parameters
    last = ""
    signatures = [blocks.graph_signature(g) if blocks.ENABLED else index for index, (g, *_r) in enumerate(graphs)]
    for passes in itertools.count(1):
        if passes > MAX_PASSES:  # what each pass learns only grows, so this is a bug: stop and say so, not hang
            raise ValueError(f"--tp {tp}: the tensor-parallel plan did not settle in {MAX_PASSES} passes over the "
                             f"stage graphs (what the passes learned kept changing: {last}). Split without --tp, "
                             f"or report it with the model file")
        walks, sent = [], {}
        for index, (g, fqn_of, needs_grad, *rest) in enumerate(graphs):
            boundary = rest[0] if rest else {}
            received = {ph: sent[name] for ph, name in boundary.get("received", {}).items() if name in sent}
            walk = None
            if index and signatures[index] == signatures[index - 1]:
                walk = _walk_like(walks[-1], graphs[index - 1], (g, fqn_of, needs_grad, *rest), received,
                                  (notes, fused, mixed, gathered, pieces), buffers[index - 1], buffers[index],
                                  sources[index - 1], sources[index])
            if walk is None:
                walk = _Walk(g, fqn_of, tp, set(notes), needs_grad, fused, sequence, received,
                             boundary.get("last", True), mixed, buffers[index], gathered, pieces, sources[index])
            outputs = list(g.output_node().args[0]) if boundary else []
            for node, name in zip(outputs, boundary.get("outputs", [])):
                if node in walk.sends:
                    sent[name] = walk.sends[node]
            walks.append(walk)
        if any(not set(walk.buffers_wanted) <= set(kept) for walk, kept in zip(walks, buffers)):
            for walk, kept in zip(walks, buffers):
                kept.update(walk.buffers_wanted)
            last = "values written in place, kept whole"
            continue  # a value written in place must be whole from where it is made: walk again
        if _learn_pieces(walks, pieces, notes):
            last = f"parameters held as pieces {sorted(pieces)[:4]}"
            continue  # a parameter read at its piece: sharded where it is made, and walk again
        if _learn_local_sources(walks, sources):
            last = "values made on a rank's piece"
            continue  # a whole value computed only to be read at a piece: computed on the piece, and walk again
        narrow: dict = {}
        if _learn_segments(walks, tp, fused, narrow):
            # the cuts were walked without their segments: walk again before deciding anything else. A projection
            # with a part tp does not divide is whole from now on (its points only grow: that part stays one tp
            # does not divide); the others' segments are learned all the same (infini-transformer's odd GEGLU
            # width of 85 once made every layer whole, its fused q, k, v included, as if never walked in parts)
            notes.update({fqn: why for fqn, why in narrow.items() if fqn not in notes})
            last = f"fused projections' segments {dict(list(fused.items())[:4])}"
            continue
        if _learn_whole_parts(walks, fused, mixed, notes, narrow):
            last = f"fused projections' whole parts {dict(list(mixed.items())[:4])}"
            continue  # a key/value part needed whole: compute it whole, shard the rest, and walk again
        uses: dict = {}
        segments: dict = {}
        columns: dict = {}  # fqn -> why, of _narrow_columns
        closing: set = set()
        for walk, seen in zip(walks, reasons):
            seen.update(dict.fromkeys(walk.reasons))
            found = _narrow_columns(walk, closing)
            columns.update(found)
            narrow.update(found)
            for fqn, why in walk.unfusable.items():
                narrow.setdefault(fqn, f"a fused projection: {why}")
            for fqn, dims in walk.uses.items():
                uses.setdefault(fqn, set()).update(dims)
            for fqn, parts in walk.param_segments.items():
                segments.setdefault(fqn, set()).add(parts)
        for fqn in closing & set(columns):  # closed in another use: only this call's output gathered
            if narrow.get(fqn) == columns[fqn]:
                del narrow[fqn]
        for fqn, dims in uses.items():
            if len(dims) > 1:
                narrow.setdefault(fqn, "used sharded in one place and whole in another")
            elif len(segments.get(fqn, ())) > 1:
                narrow.setdefault(fqn, "its uses cut it into different parts")
        new = {fqn: why for fqn, why in narrow.items() if fqn not in notes}
        if not new:
            return walks, uses, reasons
        notes.update(new)
        last = f"parameters made whole {sorted(new)[:4]}"


def _walk_like(walk: _Walk, before: tuple, here: tuple, received: dict, learned: tuple, buffers_before: dict,
               buffers_here: dict, sources_before: dict = None, sources_here: dict = None):
    """The walk of the graph ``here`` as the walk of ``before`` (a graph of the same structure) mapped onto it, or
    None where a walk could differ: it receives otherwise, is the last stage where the other is not, or the
    facts learned of its parameters (replicated, fused segments, whole parts, pieces, low-rank pairs) or of its
    values written in place are not the other's."""
    from tracepp.split import blocks

    g0, fqn0, _flags0, *rest0 = before
    g1, fqn1, flags1, *rest1 = here
    boundary0, boundary1 = (rest0[0] if rest0 else {}), (rest1[0] if rest1 else {})
    if boundary0.get("last", True) != boundary1.get("last", True):
        return None
    nodes, strings = blocks.graph_maps(g0, g1, fqn0, fqn1)
    if {strings.get(k, k): v for k, v in walk.received.items()} != received:
        return None
    if {strings.get(k, k): v for k, v in buffers_before.items()} != buffers_here:
        return None
    if {strings.get(k, k): v for k, v in (sources_before or {}).items()} != (sources_here or {}):
        return None
    mine, theirs = set(fqn0.values()), set(fqn1.values())
    for facts in learned:
        if facts is None:
            continue
        seen = ({strings.get(k, k): blocks.rename_words(v, strings) for k, v in facts.items() if k in mine}
                if isinstance(facts, dict) else None)
        own = {k: v for k, v in facts.items() if k in theirs} if isinstance(facts, dict) else None
        if seen != own:
            return None
    if any(flags1.get(nodes[node]) != flag for node, flag in walk.needs_grad.items() if node in nodes):
        return None
    return blocks.map_object(walk, nodes, strings, {"graph": g1, "fqn_of": fqn1, "needs_grad": flags1,
                                                    "received": received})
