"""Every expert-parallel plan checked before anything is written: each stage's program as ``expert_parallel.apply``
rewrote it run for every rank of an expert-parallel group, in this one process, against the stage graph as it was
before the rewrite, forward and backward. The interpreter, the inputs and the comparison are ``split/verify.py``'s.

``tracepp split --ep E`` (and ``check``) calls :func:`check` after ``expert_parallel.apply``:

* **Which ranks run.** One expert-parallel group: E ranks that are E data-parallel replicas (``--dp N``: the first
  E of the N; the other N / E groups run the same program on other rows), each with a microbatch of its own: stage
  0 reads replica e's first microbatch of the model file's example batch (samples ``e x batch / dp`` on, as the job
  cuts the batch), every later stage what the unsharded run of the stage before it gave that rank. With ``--tp T``
  each of the E ranks is T tp ranks (the grid of ``verify.run``: E x T values, the tp collectives over each
  replica's T, the all-to-alls over the E ranks of one tp index), each holding its tp pieces as the tp plan cuts
  them. With ``--cp C`` the expert-parallel ranks are cp ranks of one replica (ep index = cp index mod E; C x T
  ranks run), so the E ranks hold chunks of the same sequences; an ep group spanning several replicas' cp ranks
  (E > C) is not run. Everything floating runs in float64; the model's own parameters (random ones on meta).
* **Each rank's program.** The rewritten graph is interpreted once with each value a list over the ranks. An
  ordinary op runs per rank; ``tracepp.ep_dispatch`` and ``tracepp.ep_combine`` run the runtime's own ops for each
  rank (``runtime/expert_parallel.py``: its counts, its regrouping by local expert, its zeros for rows no expert
  took, with the runtime's ``_STATE`` set to the rank), and the ``dist.all_to_all_single`` they call is answered
  across the group (each rank's rows cut by its send splits, every rank's receive splits checked against what its
  peers send: a mismatch a real job would hang or fail on is a mismatch here). Each is an autograd function over
  the group whose backward is the runtime's own: the op's registered backward run per rank on the graph its
  forward left (dispatch's: a combine of the gradient, combine's: a dispatch of it), its all-to-all answered the
  same way. ``tracepp.grouped_mm`` runs the runtime's loop (torch's kernel takes no float64),
  ``tracepp.ep_expert_ids`` the runtime's op.
* **Parameters.** Each rank holds what the runtime loads: its experts of each expert weight and bias, cut by the
  runtime's ``expert_parallel.piece_for`` (after ``tensor_parallel.shard`` with --tp, as ``runtime/pipeline.py``
  chains them); every other parameter whole (its tp piece).
* **What is compared.** Per rank, the stage's outputs and the gradients of its received inputs, against the
  unsharded graph run on that rank's inputs and seeded with the same output gradients. Parameter gradients as
  the job reduces them: a replicated parameter's (FSDP's or DDP's mean over dp) is the mean over the simulated
  ranks of each rank's own; an expert weight's (``reduce_expert_grads``: summed over the ranks holding the same
  experts, divided by dp) is its ranks' pieces joined along the expert dim, each summed over the groups that hold
  it (none at cp = E) and divided by the ranks simulated; both against the mean of the unsharded runs' gradients,
  within ``verify.RTOL``.
* **On a mismatch.** The first value in the rewritten graph's order whose ranks do not hold what the unsharded runs
  say, named with its op and the model's source line: a value outside the experts (each rank's own), an expert
  weight's cast or view (the rank's experts of it), the rows ``ep_dispatch`` gives a rank and their offsets, a value
  between the expert matmuls (the unsharded runs' rows of the rank's experts, from every rank, expert by expert),
  ``ep_combine``'s rows (the last expert matmul's, back at their tokens' rank). Where the forward agrees and a
  gradient does not, the first all-to-all in backward order whose input gradient differs. A rewritten program that
  does not run on the ranks' values is named at its op. There is no repair: the split is refused (``--verify on``
  and ``strict`` alike; ``off`` skips the check).

Repeated stages and stages over ``verify.LIMIT`` elements are handled as the tp verification handles them; a
stage without routed experts runs unsharded only, to feed the next. ``manifest["ep"]["verified"]`` records what
was done and which ranks ran.

Cost (the 2-core machine, loaded; ``split_model`` with the folder written, median of 5 splits in one process): 3.8 -
6.7 % of the split (0.04 - 0.12 s) for the ep test models at ep 2 (Mixtral, Qwen3-MoE, DeepSeek-V3, torchtitan's
spelling, expert dims, transformers' sentinel mask), 7.2 % for Mixtral at ep 4, 8.1 % at tp 2 x ep 2, 5.0 % over cp
2; a process's first split 6.1 %, mostly a full garbage collection that fell in the step (1.7 % without it). The
work is 2 x E runs of each stage, so a stage heavy for its size costs more (docs/expert-parallel.md).
"""
from __future__ import annotations

import functools
import itertools
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.fx as fx

from tracepp.runtime import expert_parallel as ep_runtime
from tracepp.runtime import tensor_parallel as tp_runtime
from tracepp.split import verify as common
from tracepp.split import local_ranks
from tracepp.split.local_ranks import NotVerified, _across
from tracepp.split.verify import Mismatch, _differs, _op, _where

EP = torch.ops.tracepp


def snapshot(graph) -> tuple:
    """What ``expert_parallel.apply`` changes: each stage graph (and the boundary shapes, as ``verify.snapshot``)."""
    return common.snapshot(graph)


# ---- the ranks run

class Grid:
    """The ranks simulated, ``tp`` x ``outer`` values as ``verify.run`` lays them out (rank i: tp rank ``i % tp`` of
    outer rank ``i // tp``). Without --cp the outer ranks are the ep group's ``ep`` replicas; with it the ``cp``
    ranks of one replica, ep index ``c % ep``."""

    def __init__(self, layout):
        self.tp, self.ep, self.cp = layout.tp, layout.ep, layout.cp
        if self.cp > 1 and self.cp % self.ep:
            raise NotVerified(f"--ep {self.ep} groups span the --cp {self.cp} ranks of several replicas (ep does not "
                              f"divide cp): a group across replicas is not simulated here")
        self.outer = self.ep if self.cp == 1 else self.cp
        self.count = self.tp * self.outer
        self.groups = [[(first + e) * self.tp + t for e in range(self.ep)]
                       for t in range(self.tp) for first in range(0, self.outer, self.ep)]
        self.group_of = {i: group for group in self.groups for i in group}

    def ep_rank(self, i: int) -> int:
        return (i // self.tp) % self.ep

    def replica(self, i: int) -> int:
        """The data-parallel replica whose microbatch rank ``i`` runs (0 with --cp: one replica's cp ranks)."""
        return i // self.tp if self.cp == 1 else 0

    def text(self) -> str:
        if self.cp == 1:
            ranks = f"{self.ep} ep ranks (dp replicas 0 - {self.ep - 1}, each its own microbatch)"
        else:
            ranks = (f"the {self.cp} cp ranks of replica 0 ({self.cp // self.ep} ep group"
                     f"{'s' if self.cp // self.ep > 1 else ''} of {self.ep})")
        return ranks + (f" x {self.tp} tp ranks" if self.tp > 1 else "")


# ---- the all-to-all answered across a group

class _Pending(Exception):
    """A rank reached an all-to-all whose peers' inputs are not all known yet."""


def _all_to_all(calls: list) -> list:
    """``dist.all_to_all_single`` over a group: each rank's (input, input splits, output splits, output shape) ->
    each rank's output. Raises where what a rank sends another is not what that one expects."""
    size = len(calls)
    parts = []
    for source, (rows, send, _receive, _shape) in enumerate(calls):
        send = list(send) if send is not None else [rows.shape[0] // size] * size
        if sum(send) != rows.shape[0]:
            raise RuntimeError(f"all-to-all over the ep group: ep rank {source} sends {sum(send)} rows of "
                               f"{rows.shape[0]}")
        parts.append(torch.split(rows, send))
    outs = []
    for rank, (_rows, _send, receive, shape) in enumerate(calls):
        got = [parts[source][rank] for source in range(size)]
        for source, piece in enumerate(got):
            if receive is not None and piece.shape[0] != receive[source]:
                raise RuntimeError(f"all-to-all over the ep group: ep rank {source} sends {piece.shape[0]} rows to "
                                   f"ep rank {rank}, which expects {receive[source]}")
        out = torch.cat(got)
        if tuple(out.shape) != tuple(shape):
            raise RuntimeError(f"all-to-all over the ep group: ep rank {rank} receives {list(out.shape)} into "
                               f"{list(shape)}")
        outs.append(out)
    return outs


def _spmd(fns: list) -> list:
    """``fns[k]()`` for each rank k of a group, one after another, with the runtime's ``_STATE`` set to the rank and
    every ``dist.all_to_all_single`` they make answered across them: the functions run again from the start until
    every rank's calls are known (each all-to-all's inputs gathered from a pass in which every rank stopped at it)."""
    size, known = len(fns), []
    while True:
        pending, results = [None] * size, [None] * size
        for rank, fn in enumerate(fns):
            calls = itertools.count()

            def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                                  async_op=False, rank=rank, calls=calls):
                index = next(calls)
                if index < len(known):
                    output.copy_(known[index][rank])
                    return None
                pending[rank] = (input.detach().clone(), input_split_sizes, output_split_sizes, output.shape)
                raise _Pending()

            ep_runtime._STATE.update(size=size, rank=rank, group="simulated", planning=None)
            with mock.patch.object(dist, "all_to_all_single", all_to_all_single):
                try:
                    results[rank] = fn()
                except _Pending:
                    pass
        waiting = [item is not None for item in pending]
        if not any(waiting):
            return results
        if not all(waiting):
            raise RuntimeError(f"the ep ranks make different all-to-alls: ep rank {waiting.index(False)} makes "
                               f"{len(known)}, ep rank {waiting.index(True)} more")
        known.append(_all_to_all(pending))


def _simulations(grid: Grid) -> dict:
    """``verify.run``'s ``extra``: the expert-parallel ops over ``grid``'s ep groups. Dispatch and combine run the
    runtime's op per rank (with autograd, on a leaf of the rank's rows); their backward is the op's registered
    backward on that graph, its all-to-alls answered across the group as the forward's were."""
    def per_rank(node, at):
        return [fx.node.map_aggregate(node.args, at(i)) for i in range(grid.count)]

    def exchange(node, at, op, first_only):
        args, outs = per_rank(node, at), [None] * grid.count
        for group in grid.groups:
            rows, rest, made = [args[i][0] for i in group], [tuple(args[i][1:]) for i in group], {}

            def forward(xs, rest=rest, made=made):
                leaves = [x.detach().requires_grad_(x.requires_grad) for x in xs]

                def one(k):
                    with torch.enable_grad():
                        return op(leaves[k], *rest[k])

                made["leaves"], made["results"] = leaves, _spmd([functools.partial(one, k) for k in range(len(xs))])
                return [(r[0] if first_only else r).detach() for r in made["results"]]

            def backward(gs, made=made):
                def one(k):  # again on each pass of _spmd: the graph kept
                    out = made["results"][k][0] if first_only else made["results"][k]
                    if not out.requires_grad:
                        return torch.zeros_like(made["leaves"][k])
                    return torch.autograd.grad(out, made["leaves"][k], gs[k], retain_graph=True)[0]
                return _spmd([functools.partial(one, k) for k in range(len(gs))])

            moved = _across(rows, forward, backward)
            for k, i in enumerate(group):
                outs[i] = (moved[k], *made["results"][k][1:]) if first_only else moved[k]
        return outs

    def locally(fn):
        return lambda node, at: [fn(*args) for args in per_rank(node, at)]

    return {"ep_dispatch": lambda node, at: exchange(node, at, EP.ep_dispatch.default, True),
            "ep_combine": lambda node, at: exchange(node, at, EP.ep_combine.default, False),
            "ep_expert_ids": locally(EP.ep_expert_ids.default),
            "grouped_mm": locally(local_ranks._grouped_mm)}


class _RuntimeState:
    """The expert-parallel runtime's ``_STATE`` and token counts as they were, after the simulation."""

    def __enter__(self):
        self.state, self.stats = dict(ep_runtime._STATE), dict(ep_runtime._STATS)

    def __exit__(self, *exc):
        ep_runtime._STATE.clear()
        ep_runtime._STATE.update(self.state)
        ep_runtime._STATS.clear()
        ep_runtime._STATS.update(self.stats)


# ---- what each rank should hold

def _ends(offsets) -> list:
    return offsets.detach().to(torch.int64).reshape(-1).tolist()


def _regrouped(values: list, offsets: list, group: list, rank: int, local: int):
    """What ep rank ``rank`` of ``group`` holds of a value with a row per sorted (token, expert) pair: its experts'
    rows from every rank of the group, expert by expert (the group's ranks in order within an expert), from the
    unsharded runs' ``values`` and ``offsets`` (per grid rank); rows past the last offset (no expert) left out."""
    pieces = []
    for expert in range(rank * local, (rank + 1) * local):
        for source in group:
            ends = _ends(offsets[source])
            pieces.append(values[source][(ends[expert - 1] if expert else 0):ends[expert]])
    return torch.cat(pieces)


class _Places:
    """Where the rewritten graph's values sit: the region each ``ep_dispatch`` opens (its rows to its ``ep_combine``),
    the expert weights' casts and views (their expert dims)."""

    def __init__(self, rewritten: fx.Graph, blocks: list, ep: int):
        self.region, self.weights = {}, {}
        for node in rewritten.nodes:
            if node.target is not EP.ep_dispatch.default:
                continue
            rows = [u for u in node.users if u.args[1] == 0]
            seen, stack = set(), list(rows)
            while stack:
                item = stack.pop()
                if item in seen or item.target is EP.ep_combine.default:
                    continue
                seen.add(item)
                stack.extend(item.users)
            for item in seen:
                self.region[item.name] = node
        for block in blocks:
            local = block.num_experts // ep
            for item, dim in block.weight_paths:
                self.weights[item.name] = (dim, local)


def _expected(node, places: _Places, grid: Grid, ref_env: dict, i: int):
    """(what, the value rank ``i`` should hold) for a rewritten node, or None where it is not compared."""
    e, group = grid.ep_rank(i), grid.group_of[i]
    if node.target is EP.ep_dispatch.default:
        rows, offsets, experts = node.args[0], node.args[1], node.args[2]
        local = experts // grid.ep
        want_rows = _regrouped(ref_env[rows.name], ref_env[offsets.name], group, e, local)
        counts = local_ranks._sum([torch.diff(torch.tensor([0] + _ends(ref_env[offsets.name][s]))) for s in group])
        return (f"the rows {node.name} gives ep rank {e} (its experts' rows from every ep rank, by expert)",
                (want_rows, torch.cumsum(counts[e * local:(e + 1) * local], 0)))
    if node.target is EP.ep_combine.default:
        last = node.args[0]
        want = ref_env.get(last.name, [None] * grid.count)[i]
        return (f"the value of {node.name} ({last.name}'s rows back on their tokens' rank)", want) \
            if isinstance(want, torch.Tensor) else None
    if node.name not in ref_env:
        return None
    if node.name in places.region:
        dispatch = places.region[node.name]
        rows, offsets = ref_env[dispatch.args[0].name], ref_env[dispatch.args[1].name]
        values = ref_env[node.name]
        if not all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows[s].shape[0]
                   for s, v in zip(group, [values[s] for s in group])):
            return None  # not one row per pair
        local = dispatch.args[2] // grid.ep
        return (f"the value of {node.name} on ep rank {e} (the rows of its experts)",
                _regrouped(values, offsets, group, e, local))
    want = ref_env[node.name][i]
    if not isinstance(want, torch.Tensor):
        return None
    if node.name in places.weights:
        dim, local = places.weights[node.name]
        return (f"the value of {node.name} on ep rank {e} (its experts {e * local} - {(e + 1) * local - 1})",
                want.narrow(dim, e * local, local))
    return (f"the value of {node.name}", want)


def _compare(have, want):
    if isinstance(want, tuple):  # dispatch: (rows, offsets)
        if not isinstance(have, (tuple, list)):
            return None
        return _differs(have[0], want[0]) or _differs(have[1].to(torch.int64), want[1])
    return _differs(have, want)


def _first_difference(label, rewritten, env, ref_env, places, grid):
    """The first value of the rewritten graph, in order, that some rank does not hold as the unsharded runs say."""
    for node in rewritten.nodes:
        if node.op != "call_function" or node.name not in env:
            continue
        for i in range(grid.count):
            expected = _expected(node, places, grid, ref_env, i)
            if expected is None:
                break
            what, want = expected
            found = _compare(env[node.name][i], want)
            if found:
                at = f" at tp rank {i % grid.tp}" if grid.tp > 1 else ""
                return Mismatch(label, what + at, node.name, _op(node), _where(node), found[0], found[1])
    return None


def _backward_difference(label, rewritten, env, ref_env, places, grid):
    """Where the forward agrees and a gradient does not: the first all-to-all, in backward order, whose input's
    gradient is not the unsharded runs' (retained by :func:`_stage`)."""
    for node in reversed(list(rewritten.nodes)):
        if node.target not in (EP.ep_dispatch.default, EP.ep_combine.default):
            continue
        source = node.args[0]
        for i in range(grid.count):
            have = env[source.name][i]
            have = have.grad if isinstance(have, torch.Tensor) else None
            if node.target is EP.ep_combine.default:  # its input: the rank's experts' rows
                dispatch = places.region.get(source.name)
                grads = [g.grad for g in ref_env[source.name]]
                if dispatch is None or any(g is None for g in grads):
                    break
                want = _regrouped(grads, ref_env[dispatch.args[1].name], grid.group_of[i], grid.ep_rank(i),
                                  dispatch.args[2] // grid.ep)
                what = f"the gradient of {source.name} on ep rank {grid.ep_rank(i)} ({node.name}'s backward)"
            else:
                want = ref_env[source.name][i].grad
                what = f"the gradient of {source.name} on ep rank {grid.ep_rank(i)} ({node.name}'s backward)"
            if have is None or want is None:
                break
            found = _differs(have, want)
            if found:
                return Mismatch(label, what, node.name, _op(node), _where(node), found[0], found[1])
    return None


# ---- one stage

def _inputs(graph, stage, original, grid: Grid, traced, values, generator, training, tp_params: dict):
    """verify.Inputs, with per placeholder a value for every rank of the grid: a root input replica by replica (each
    ep rank its own microbatch), a parameter's tp piece, a received value each rank's own."""
    inputs = common.Inputs(graph, stage, original, traced, values, generator, training)
    placeholders = [n for n in original.nodes if n.op == "placeholder"]
    state = dict(zip([n.name for n in placeholders], stage.state))
    roots = dict(zip([n.name for n in placeholders[len(stage.state):]], stage.root_inputs))
    tensors = []
    for node, tensor in zip(placeholders, inputs.tensors):
        val = node.meta.get("val")
        if node.name in roots and isinstance(tensor, torch.Tensor):
            ref, per = graph.root_inputs[roots[node.name]], []
            for i in range(grid.count):
                replica = grid.replica(i)
                if replica == 0:
                    per.append(tensor)
                    continue
                other = common._root_value(traced, ref, val, replica * traced.batch_size)
                per.append(common._cast(other) if other is not None else
                           common._random_like(val, generator) if tensor.is_floating_point() else tensor)
            tensors.append(per)
        elif node.name in state and isinstance(tensor, torch.Tensor) and grid.tp > 1:
            entry = tp_params.get(graph.state[state[node.name]].fqn) or {}
            dim = entry.get("dim")
            if dim is None or tensor.shape[dim] == common._concrete(val)[dim]:  # whole, or a random piece already
                tensors.append(tensor)
            else:
                tensors.append([tp_runtime.shard(tensor, dim, grid.tp, i % grid.tp, entry.get("segments"))
                                for i in range(grid.count)])
        else:
            tensors.append(tensor)
    return inputs, tensors


def _repeat_of(original, seen: list):
    """The index of a stage verified already whose graph is ``original``'s in structure (``split.blocks.
    graph_signature``: a pipeline's middle stages), or None; signatures computed only for graphs of as many nodes
    (two stages of a small pipeline rarely match, and blocks.py is a large module to import)."""
    size = len(original.nodes)
    candidates = [(graph, index) for graph, index in seen if len(graph.nodes) == size]
    if not candidates:
        return None
    from tracepp.split.blocks import graph_signature

    signature = graph_signature(original)
    return next((index for graph, index in candidates if graph_signature(graph) == signature), None)


def _stage(graph, stage, original, blocks, grid, ep_plan, tp_params, fqn_of, traced, values, generator, seen,
           training) -> dict:
    inputs, tensors = _inputs(graph, stage, original, grid, traced, values, generator, training, tp_params)
    live = [b for b in blocks if not b.refused]
    retain = {b.rows.name for b in live} | {b.out.name for b in live} if training else set()
    leaves, ref_env, outputs, seeds = common.reference(original, tensors, inputs.wanted, stage.outputs, values,
                                                       generator, cp=grid.outer, size=grid.tp, retain=retain)
    if not live:
        return {"status": "verified", "why": "no routed experts: unchanged"}
    repeat = _repeat_of(original, seen)
    if repeat is not None:
        return {"status": "verified", "why": f"the same graph as stage {repeat}"}
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    manifest = {"ep": ep_plan.to_json()}
    ranked = []  # from the inputs, not the reference's leaves: the reference run may have written into those
    for node, given, wants in zip(placeholders, tensors, inputs.wanted):
        per = given if isinstance(given, list) else [given] * grid.count
        if not isinstance(per[0], torch.Tensor):
            ranked.append(list(per))
            continue
        fqn = fqn_of.get(node.name)
        cut = [x.detach() for x in per]
        if fqn in ep_plan.params:  # this rank's experts, cut as the runtime loads them
            cut = [ep_runtime.piece_for(manifest, grid.ep, grid.ep_rank(i))(fqn, x) for i, x in enumerate(cut)]
        ranked.append([x.detach().clone().requires_grad_(wants) for x in cut])
    try:
        env = local_ranks.run(stage.graph, ranked, grid.tp, grid.outer, extra=_simulations(grid))
    except NotVerified:
        raise
    except Exception as error:  # the unsharded program ran: the rewrite is wrong at this op
        node = getattr(error, "verify_node", None)
        if node is None or node.op != "call_function":
            raise
        places = _Places(stage.graph, live, grid.ep)
        first = _first_difference(stage.index, stage.graph, error.verify_env, ref_env, places, grid)
        text = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        if first is not None:
            first.what = f"{first.what} (and so {node.name} fails: {text})"
            return {"status": "mismatch", "mismatch": first}
        return {"status": "mismatch", "mismatch": Mismatch(stage.index, f"the value of {node.name}", node.name,
                                                           _op(node), _where(node), failed=text)}
    results = env[stage.graph.output_node().name]
    mismatch = None
    for i in range(grid.count):
        for index, name in enumerate(stage.outputs):
            found = _differs(results[i][index], outputs[i][index])
            if found:
                mismatch = Mismatch(stage.index, f"output {name} of ep rank {grid.ep_rank(i)}", error=found[0],
                                    scale=found[1])
                break
        if mismatch:
            break
    backward = False
    if mismatch is None and training:
        for name in retain:
            for value in env.get(name, []):
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    value.retain_grad()
        pairs = [(out, seed) for i in range(grid.count) for out, seed in zip(results[i], seeds[i])
                 if seed is not None and isinstance(out, torch.Tensor) and out.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _g in pairs], [g for _o, g in pairs])
        mismatch = _gradients(stage, placeholders, ranked, leaves, inputs, fqn_of, ep_plan, grid)
        backward = mismatch is not None
    if mismatch is not None:
        places = _Places(stage.graph, live, grid.ep)
        first = _first_difference(stage.index, stage.graph, env, ref_env, places, grid)
        if first is None and backward:
            first = _backward_difference(stage.index, stage.graph, env, ref_env, places, grid)
        if first is not None:
            first.what = f"{first.what} (and so {mismatch.what})"
            mismatch = first
        return {"status": "mismatch", "mismatch": mismatch}
    seen.append((original, stage.index))
    return {"status": "verified", "why": ""}


def _grad(tensor):
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)


def _gradients(stage, placeholders, ranked, leaves, inputs, fqn_of, ep_plan, grid):
    """The received inputs' gradients per rank; the parameters' as the job reduces them (the module docstring)."""
    for node, pieces, refs, wants in zip(placeholders, ranked, leaves, inputs.wanted):
        if not wants:
            continue
        fqn = fqn_of.get(node.name)
        if node.name in inputs.received:
            for i in range(grid.count):
                found = _differs(_grad(pieces[i]), _grad(refs[i]))
                if found:
                    return Mismatch(stage.index, f"the gradient of input {inputs.received[node.name]} on ep rank "
                                                 f"{grid.ep_rank(i)}", error=found[0], scale=found[1])
            continue
        for t in range(grid.tp):
            mine = [i for i in range(grid.count) if i % grid.tp == t]
            want = local_ranks._sum([_grad(refs[i]) for i in mine]) / grid.outer
            if fqn in ep_plan.params:
                dim = ep_plan.params[fqn]["dim"]
                per_expert_rank = [local_ranks._sum([_grad(pieces[i]) for i in mine if grid.ep_rank(i) == e])
                                   for e in range(grid.ep)]
                have = torch.cat(per_expert_rank, dim=dim) / grid.outer
            else:
                have = local_ranks._sum([_grad(pieces[i]) for i in mine]) / grid.outer
            found = _differs(have, want)
            if found:
                what = f"the gradient of {fqn or node.name}" + (f" at tp rank {t}" if grid.tp > 1 else "")
                return Mismatch(stage.index, what + " (reduced over the ranks as the job reduces it)",
                                error=found[0], scale=found[1])
    return None


# ---- one plan

def verify(graph, saved: tuple, ep_plan, per_stage: list, traced, layout, tp_params: dict = None,
           training: bool = True) -> dict:
    """Run every stage as rewritten against its snapshot (:func:`snapshot`); returns {"status": "verified" |
    "mismatch" | "not verified", "why", "mismatch", "stages", "ranks"}."""
    from tracepp.split.tensor_parallel import fqn_map

    originals, _shapes = saved
    generator = torch.Generator().manual_seed(0)
    values: dict = {}
    done = []
    try:
        grid = Grid(layout)
    except NotVerified as error:
        return {"status": "not verified", "why": str(error), "mismatch": None, "stages": [], "ranks": ""}
    if getattr(traced, "random_ops", None):
        return {"status": "not verified", "why": f"the model draws random numbers ({traced.random_ops[0]}): the "
                                                 f"ranks' draws differ from one process's", "mismatch": None,
                "stages": [], "ranks": grid.text()}
    seen: list = []  # (graph, stage index) verified
    for stage, original, blocks in zip(graph.stages, originals, per_stage):
        try:
            with _RuntimeState():
                    result = _stage(graph, stage, original, blocks, grid, ep_plan, tp_params or {},
                                fqn_map(stage, graph), traced, values, generator, seen, training)
        except NotVerified as error:
            result = {"status": "not verified", "why": str(error)}
        except Exception as error:  # an op that does not run here: say so, do not fail the split
            result = {"status": "not verified", "why": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        result["what"] = f"stage {stage.index}"
        done.append(result)
        if result.get("mismatch") is not None:
            return {"status": "mismatch", "why": result["mismatch"].text(), "mismatch": result["mismatch"],
                    "stages": done, "ranks": grid.text()}
        if result["status"] == "not verified":
            break  # the later stages' inputs are not known
    skipped = [f"{r['what']}: {r['why']}" for r in done if r["status"] == "not verified"]
    status = "not verified" if skipped or len(done) < len(graph.stages) else "verified"
    return {"status": status, "why": "; ".join(skipped) if status != "verified" else "", "mismatch": None,
            "stages": done, "ranks": grid.text()}


def check(graph, saved: tuple, ep_plan, per_stage: list, traced, layout, tp_params: dict = None, mode: str = "on",
          training: bool = True) -> tuple:
    """Verify the applied ep plan; a mismatch refuses the split (no repair: ``on`` and ``strict`` alike). Returns
    (the record for the manifest, notes for the user)."""
    started = time.perf_counter()
    result = common.single_threaded(lambda: verify(graph, saved, ep_plan, per_stage, traced, layout, tp_params,
                                                   training))
    record, notes = common.refused_or_recorded("ep", ep_plan.size, result, started,
                                               "the expert-parallel rewrite of that block is wrong")
    record["ranks"] = result.get("ranks", "")
    if layout.tp > 1 or layout.cp > 1:
        record["scope"] = ("the ep rewrite of the stages as tp/cp rewrote them, against those stages on the same "
                           "ranks (tp.verified and cp.verified check those rewrites against the unsharded stages)")
    return record, notes
