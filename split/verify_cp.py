"""Every context-parallel plan checked before anything is written: each stage's rewritten program (and the rewritten
loss) run for every cp rank, in this one process, against the graph as it was before the rewrite, forward and
backward. The interpreter, the inputs and the comparison are ``split/verify.py``'s (the tp verification's).

``tracepp split --cp C`` (and ``check``) calls :func:`check` after ``context_parallel.apply``:

* **What runs.** The stages in order on one microbatch, as for tp: the model file's example batch, the model's own
  parameters (random ones on meta), each stage's received values from the unsharded run of the stages before it;
  everything floating in float64. Then the loss (``graph.loss``, the model file's ``loss_fn`` traced) on the last
  stage's unsharded output and the example target.
* **How the ranks run.** The rewritten graph is interpreted once with each value a list of the ``C`` cp ranks'
  values. The inputs are what the runtime gives each rank: a value received as a sequence shard is cut to the
  rank's chunks (each sequence in ``2C`` chunks, rank r holding chunks r and 2C-1-r: the runtime's own
  ``cp_shard``), root inputs and parameters whole (the graph cuts them). ``cp_shard`` and ``cp_positions`` run per
  rank with the runtime's rank set; ``cp_all_gather``, ``cp_reduce_scatter`` and ``cp_all_reduce`` are computed
  across the list by an autograd function whose backward is the runtime's (an all-gather's gradient
  reduce-scattered, a reduce-scatter's all-gathered, an all-reduce's all-reduced).
* **What is compared.** The outputs (a shard's chunks joined in the runtime's order), and, from each rank's
  backward as the job seeds it (a sharded output's gradient cut to the rank's chunks, the loss seeded on every
  rank), the gradients of the received inputs and parameters: the cp ranks' parts summed (a shard's joined), over
  C (the job's mean over dp x cp), against the unsharded graph's, within ``verify.RTOL``.
* **On a mismatch.** The first value that differs, in the rewritten graph's order, names the op and the model's
  source line: the values the rewrite kept (a shard joined, a whole value on every rank, a sum or loss after its
  all-reduce), and the values it made for this rank's positions (``cp_positions``, a rotary table built for them:
  the rank's chunks of the whole one). A rewritten program that does not run on the ranks' values is named at its
  op. Under ``--verify on`` an op of the model found so is repaired: it runs on the whole sequence at every cp
  rank, every copy of it (its op and source line), planned and verified again (:func:`check`); a value the rewrite
  made, or any mismatch under ``strict``, refuses the split; ``off`` skips the check.

Repeated stages and stages over ``verify.LIMIT`` elements are handled as the tp verification handles them.
``manifest["cp"]["verified"]`` records what was done.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from tracepp.split import rules
from tracepp.split import verify as common
from tracepp.split import local_ranks
from tracepp.split.local_ranks import NotVerified, _cp_join, _cp_piece
from tracepp.split.verify import Mismatch, _differs, _op, _where

aten = torch.ops.aten
CP = torch.ops.tracepp


def snapshot(graph, loss=None) -> tuple:
    """What ``context_parallel.apply`` changes: the stage graphs, the boundary shapes, the loss graph."""
    return common.snapshot(graph), copy.deepcopy(loss.graph) if loss is not None else None


# ---- placements in the rewritten graph

def _replacement(node, names: set):
    """The value the consumers of a partial sum (or a loss made a sum) read: after its ``cp_all_reduce``, the
    division by the whole count where there is one."""
    reduced = [u for u in node.users if u.target is CP.cp_all_reduce.default]
    if len(reduced) != 1:
        return None
    final = reduced[0]
    divided = [u for u in final.users if u.target is aten.div.Tensor and u.name not in names]
    return divided[0] if len(divided) == 1 else final


def _expected(node, shard: dict, made: dict, ref_env, names: set, cp: int):
    """(what, per rank the value ``node`` should hold, or a whole value its ranks' values join to, how to join)
    for a node of the rewritten graph, or None where it is not compared. ``shard``: node name -> (dim, groups) of
    the walk's sequence shards; ``made``: node name -> (whole value, dim, groups) it is this rank's positions of."""
    if node.name in names:
        want = ref_env.get(node.name, [None])[0]
        return (f"the value of {node.name}", want, shard.get(node.name)) if isinstance(want, torch.Tensor) else None
    if node.name in made or node.target is CP.cp_shard.default:
        x, dim, groups = made.get(node.name) or (node.args[0], node.args[1],
                                                 node.args[2] if len(node.args) > 2 else 1)
        want = ref_env.get(x.name, [None])[0]
        if not isinstance(want, torch.Tensor):
            return None
        return (f"the value of {node.name} (this rank's positions of {x.name})",
                [_cp_piece(want, dim, groups, cp, r) for r in range(cp)], None)
    return None


def _compare(have: list, want, placed, cp: int):
    """(error, scale) where the ranks' values ``have`` are not ``want`` (a list: per rank; a tensor: whole, every
    rank's or, ``placed`` (dim, groups), the ranks' chunks joined)."""
    if isinstance(want, list):
        for h, w in zip(have, want):
            found = _differs(h, w)
            if found:
                return found
        return None
    if not all(isinstance(h, torch.Tensor) for h in have):
        return None
    if all(h.shape == want.shape for h in have):
        candidates = have
    elif placed is not None:
        try:
            candidates = [_cp_join([h.detach() for h in have], placed[0], placed[1])]
        except RuntimeError:
            return (float("inf"), 0.0)
    else:
        return None  # a value whose placement is not known here
    for h in candidates:
        found = _differs(h, want)
        if found:
            return found
    return None


def _first_difference(label, original, env, ref_env, walk, rewritten: fx.Graph, cp: int):
    """The first value of the rewritten graph, in order, whose ranks do not hold what the unsharded run says."""
    names = {n.name for n in original.nodes}
    partial = {n.name for n in walk.sums} | {n.name for n in walk.losses}
    token_local = {n.name for n in walk.expert_nodes}  # routed experts: each rank's tokens sorted its own way
    shard = {n.name: p for n, p in walk.shard.items()}
    made = {n.name: k for n, k in (getattr(walk, "made_for", None) or {}).items()}
    for node in rewritten.nodes:
        if node.op != "call_function" or node.name not in env or node.name in token_local:
            continue
        have, named = env[node.name], node
        if node.name in partial:
            final = _replacement(node, names)
            if final is None or final.name not in env:
                continue
            have = env[final.name]
        expected = _expected(node, shard, made, ref_env, names, cp)
        if expected is None:
            continue
        what, want, placed = expected
        if node.name in partial:
            what += " (summed over the cp ranks)"
        found = _compare(have, want, placed, cp)
        if found:
            return Mismatch(label, what, named.name, _op(named), _where(named), found[0], found[1])
    return None


def _failure(label, error, original, ref_env, walk, rewritten, cp):
    """A rewritten program that raised on the ranks' values: the first value that differs before it, else the op."""
    node = error.verify_node
    first = _first_difference(label, original, error.verify_env, ref_env, walk, rewritten, cp)
    text = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    if first is not None:
        first.what = f"{first.what} (and so {node.name} fails: {text})"
        return first
    return Mismatch(label, f"the value of {node.name}", node.name, _op(node), _where(node), failed=text)


# ---- one graph

def _run_ranks(label, original, rewritten, walk, cp, inputs: list, wanted: list, placements: list, labels: list,
               leaves: list, ref_env, outputs: list, seeds: list, output_placements: list, output_names: list):
    """The rewritten graph for every cp rank against the reference run; a Mismatch or None."""
    ranked = []
    for tensor, wants, placed in zip(inputs, wanted, placements):
        if not isinstance(tensor, torch.Tensor):
            ranked.append([tensor] * cp)
            continue
        pieces = ([_cp_piece(tensor, placed[0], placed[1], cp, r) for r in range(cp)] if placed else
                  [tensor for _ in range(cp)])
        ranked.append([p.detach().clone().requires_grad_(wants) for p in pieces])
    try:
        env = local_ranks.run(rewritten, ranked, 1, cp)
    except NotVerified:
        raise
    except Exception as error:
        if not hasattr(error, "verify_node"):
            raise
        return _failure(label, error, original, ref_env, walk, rewritten, cp)
    results = env[rewritten.output_node().name]
    mismatch = None
    for index, want in enumerate(outputs):
        placed = output_placements[index] if index < len(output_placements) else None
        found = _compare([results[r][index] for r in range(cp)], want, placed, cp) \
            if isinstance(want, torch.Tensor) else None
        if found:
            mismatch = Mismatch(label, output_names[index], error=found[0], scale=found[1])
            break
    if mismatch is None and any(s is not None for s in seeds):
        pairs = []
        for index, seed in enumerate(seeds):
            if seed is None:
                continue
            placed = output_placements[index] if index < len(output_placements) else None
            for r in range(cp):
                out = results[r][index]
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    # as the job seeds it: a shard's gradient is the rank's chunks of cp x the whole's
                    pairs.append((out, cp * _cp_piece(seed, placed[0], placed[1], cp, r) if placed else seed))
        if pairs:
            torch.autograd.backward([o for o, _g in pairs], [g for _o, g in pairs])
        for pieces, leaf, wants, placed, name in zip(ranked, leaves, wanted, placements, labels):
            if not wants:
                continue
            got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in pieces]
            got = _cp_join(got, placed[0], placed[1]) if placed else local_ranks._sum(got)
            want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            found = _differs(got / cp, want)
            if found:
                mismatch = Mismatch(label, f"the gradient of {name}", error=found[0], scale=found[1])
                break
    if mismatch is not None:
        first = _first_difference(label, original, env, ref_env, walk, rewritten, cp)
        if first is not None:
            first.what = f"{first.what} (and so {mismatch.what})"
            mismatch = first
    return mismatch


def _stage(graph, stage, original, walk, cp, traced, values, generator, seen, training) -> dict:
    from tracepp.split import blocks

    inputs = common.Inputs(graph, stage, original, traced, values, generator, training)
    leaves, ref_env, outputs, seeds = common.reference(original, inputs.tensors, inputs.wanted, stage.outputs,
                                                       values, generator)
    signature = blocks.graph_signature(original)
    if signature in seen:
        return {"status": "verified", "why": f"the same graph as stage {seen[signature]}"}
    names = [n.name for n in original.nodes if n.op == "placeholder"]
    placements = [walk.received.get(name) if name in inputs.received else None for name in names]
    labels = [walk.fqn_of.get(name) or (f"input {inputs.received[name]}" if name in inputs.received else name)
              for name in names]
    mismatch = _run_ranks(stage.index, original, stage.graph, walk, cp, inputs.tensors, inputs.wanted, placements,
                          labels, leaves, ref_env, outputs, seeds, list(walk.outputs),
                          [f"output {name}" for name in stage.outputs])
    if mismatch is not None:
        return {"status": "mismatch", "mismatch": mismatch}
    seen[signature] = stage.index
    return {"status": "verified", "why": ""}


def _loss(loss, original, loss_walk, cp, outputs: list, target) -> dict:
    """The rewritten loss against the model file's ``loss_fn`` as traced: on the last stage's unsharded output and
    the example target, every rank's loss and the gradient of the output."""
    placeholders = [n for n in original.nodes if n.op == "placeholder"]
    targets = iter(pytree.tree_leaves(target) if target is not None else [])
    tensors, wanted, placements = [], [], []
    for node in placeholders:
        index = loss.inputs.get(node.name)
        if index is not None:
            tensor = outputs[index] if index < len(outputs) else None
            placed = loss_walk.received.get(node.name)
        else:
            tensor, placed = next(targets, None), None
            tensor = common._cast(tensor) if isinstance(tensor, torch.Tensor) else tensor
        val = node.meta.get("val")
        if not isinstance(tensor, torch.Tensor) or (isinstance(val, torch.Tensor)
                                                    and list(tensor.shape) != common._concrete(val)):
            raise NotVerified(f"the loss's input {node.name} has no example value of its traced shape")
        tensors.append(tensor.detach())
        wanted.append(index is not None and tensor.is_floating_point())
        placements.append(placed)
    leaves, ref_env, results, ones = common.reference(
        original, tensors, wanted, [], {}, None,
        seeds=lambda outs: [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                            for o in outs])
    # every rank seeds its own loss with 1, as the job does
    labels = [node.name for node in placeholders]
    mismatch = _run_ranks("the loss", original, loss.graph, loss_walk, cp, tensors, wanted, placements, labels,
                          leaves, ref_env, results, ones, [None] * len(results),
                          [f"output {i}" if len(results) > 1 else "its value" for i in range(len(results))])
    if mismatch is not None:
        return {"status": "mismatch", "mismatch": mismatch}
    return {"status": "verified", "why": ""}


# ---- one plan

def verify(graph, saved: tuple, cp_plan, walks, loss, loss_walk, traced, target, training: bool = True) -> dict:
    """Run every stage (and the loss) as rewritten against its snapshot (:func:`snapshot`); returns {"status":
    "verified" | "mismatch" | "not verified", "why", "mismatch", "stages"}."""
    cp = cp_plan.size
    (originals, _shapes), loss_graph = saved
    generator = torch.Generator().manual_seed(0)
    values: dict = {}
    done, seen, last_outputs = [], {}, []
    if getattr(traced, "random_ops", None):
        return {"status": "not verified", "why": f"the model draws random numbers ({traced.random_ops[0]}): the "
                                                 f"ranks' draws differ from one process's", "mismatch": None,
                "stages": []}
    jobs = [("stage", stage, original, walk) for stage, original, walk in zip(graph.stages, originals, walks)]
    if loss is not None and loss_walk is not None and loss_graph is not None and training:
        jobs.append(("loss", None, loss_graph, loss_walk))
    for kind, stage, original, walk in jobs:
        try:
            if kind == "stage":
                result = _stage(graph, stage, original, walk, cp, traced, values, generator, seen, training)
                last_outputs = [values.get(name) for name in stage.outputs]
            else:
                result = _loss(loss, original, walk, cp, last_outputs, target)
        except NotVerified as error:
            result = {"status": "not verified", "why": str(error)}
        except Exception as error:  # the unsharded graph does not run here: say so, do not fail the split
            result = {"status": "not verified", "why": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        result["what"] = f"stage {stage.index}" if kind == "stage" else "the loss"
        done.append(result)
        if result.get("mismatch") is not None:
            return {"status": "mismatch", "why": result["mismatch"].text(), "mismatch": result["mismatch"],
                    "stages": done}
        if result["status"] == "not verified":
            break  # the later stages' inputs are not known
    skipped = [f"{r['what']}: {r['why']}" for r in done if r["status"] == "not verified"]
    if skipped or len(done) < len(jobs):
        return {"status": "not verified", "why": "; ".join(skipped) or "not run", "mismatch": None, "stages": done}
    return {"status": "verified", "why": "", "mismatch": None, "stages": done}


def restore(graph, saved: tuple, loss=None) -> None:
    """The stage graphs and the loss graph as :func:`snapshot` saw them (fresh copies)."""
    common.restore(graph, saved[0])
    if loss is not None and saved[1] is not None:
        loss.graph = copy.deepcopy(saved[1])


def _forced_key(saved: tuple, mismatch):
    """(op, source line) of the op of the unsharded stage (or loss) graph the first differing value is: what a
    repair runs on the whole sequence; None where it is a value the rewrite made (a cut, a position table), or an
    op with no source line to find its copies by."""
    graphs = list(saved[0][0]) + ([saved[1]] if saved[1] is not None else [])
    index = mismatch.stage if isinstance(mismatch.stage, int) else len(graphs) - 1
    if not mismatch.node or not 0 <= index < len(graphs):
        return None
    found = next((n for n in graphs[index].nodes if n.name == mismatch.node and n.op == "call_function"), None)
    if found is None or not _where(found):
        return None
    return rules.op_name(found), _where(found)


def check(graph, saved: tuple, cp_plan, walks, loss, loss_walk, traced, target, mode: str = "on",
          training: bool = True, tp: int = 1, replan=None) -> tuple:
    """Verify the applied cp plan. On a mismatch (``mode`` "on", ``replan`` given) the op the first differing value
    is runs on the whole sequence at every cp rank, wherever it stands (its op and source line: every repeated
    block's copy), ``replan(forced)`` plans and applies again from the snapshot (returning (plan, walks, loss
    walk)), and the plan is verified again; ``strict``, or a value the rewrite made, refuses naming the op.
    Returns (plan, walks, loss walk, the record for the manifest, notes for the user)."""
    started = time.perf_counter()
    forced, repairs, notes = set(), [], []
    for _round in range(common.ROUNDS):
        result = common.single_threaded(lambda: verify(graph, saved, cp_plan, walks, loss, loss_walk, traced, target,
                                                       training))
        if result["status"] != "mismatch" or mode == "strict" or replan is None:
            break
        mismatch = result["mismatch"]
        key = _forced_key(saved, mismatch)
        if key is None or key in forced:
            break
        forced.add(key)
        cp_plan, walks, loss_walk = replan(frozenset(forced))
        repairs.append({"op": key[0], "at": key[1], "value": mismatch.what})
        notes.append(f"--cp {cp_plan.size}: verification found {mismatch.text()}; {key[0]} at {key[1]} now runs on "
                     f"the whole sequence at every cp rank (its sequence shards all-gathered first)")
    record, more = common.refused_or_recorded("cp", cp_plan.size, result, started, "the cp rule for that op is wrong")
    if repairs:
        record["repairs"] = repairs
        if record["status"] == "verified":
            record["status"] = "repaired"
    if tp > 1:
        record["scope"] = ("the cp rewrite against the unsharded stages (cp ranks; tp's rewrite of it is checked "
                           "per (tp, cp) rank pair: tp.verified)")
    return cp_plan, walks, loss_walk, record, notes + more
