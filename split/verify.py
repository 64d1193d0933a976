"""Every tensor-parallel plan checked before anything is written: each stage's rewritten program run for every tp
rank, in this one process, against the stage graph as it was before the rewrite, forward and backward.

``tracepp split --tp T`` (and ``check``) calls :func:`verify_and_repair` after ``tensor_parallel.apply``:

* **What runs.** The stages in order, on one microbatch: the model file's example batch (its first microbatch) for
  the root inputs, the model's own parameters and buffers where they are real (random ones where the model is on
  meta tensors), each stage's received values from the unsharded run of the stages before it. Everything floating
  runs in float64 (every floating dtype argument of the graphs is read as float64), so both programs compute in
  the same precision and only the order of the sums differs.
* **How the ranks run.** The rewritten graph is one program for every tp rank (SPMD). It is interpreted once with
  each value a list of ``T`` per-rank values: an ordinary op runs on each rank's operands; tracepp's collectives
  (``runtime/tensor_parallel.py``: ``tp_copy``, ``tp_all_reduce``, ``tp_all_gather``, ``tp_scatter``, ``tp_piece``,
  ``sp_all_gather``, ``sp_reduce_scatter``, ``tp_vocab_embedding``, ``tp_head_group``, ``tp_parts``; and the local
  ``tp_owned_split``) are computed across the list by an autograd function whose backward is the runtime's: a
  ``tp_copy`` sums its ranks' gradients, a ``tp_all_reduce`` passes each rank's through, and so on. Each rank has
  leaves of its own (its parameter pieces, its copy of each input), so autograd gives each rank's gradients as the
  job would compute them.
* **What is compared.** The stage's outputs, the gradients of its received inputs and of its parameters (a sharded
  parameter's pieces joined in the model's layout, ``original_layout``; a replicated one on every rank; one whose
  gradient is summed once per step, ``"grad": "partial"``, as the sum of the ranks' parts), against the
  unsharded graph on the same inputs and output gradients: equal within ``RTOL`` of the largest magnitude of the
  value (float64: the sharded sums differ from the whole ones by rounding only).
* **On a mismatch.** The first value that differs, in graph order, of those the rewrite kept and whose placement
  is known (sharded pieces joined; partial sums before their all-reduce are skipped), names the op and the model's
  source line. :func:`verify_and_repair` makes the parameters whose shards feed that value whole (as a model file's
  ``tp_plan`` ``"replicate"`` does), plans again and verifies again, for at most ``ROUNDS`` rounds; ``strict``
  refuses instead.

A stage whose parameters and inputs hold more than ``LIMIT`` elements (a real-size model traced on meta tensors) is
not run; a stage graph equal in structure to one verified already (``split.blocks.graph_signature``: a pipeline's
middle stages) runs unsharded only, to feed the next. What was done is recorded as ``manifest["tp"]["verified"]``.

The ranks run in ``split/local_ranks.py`` (:func:`~tracepp.split.local_ranks.run`: a grid of tp x cp ranks, each
collective over its own group, cp's collectives too). With ``--cp`` the tp verification's reference
is the cp-rewritten stages run for every cp rank; ``split/verify_cp.py`` verifies the cp rewrite itself.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tracepp.runtime import tensor_parallel as tp_runtime
from tracepp.split.local_ranks import NotVerified, _float64, _join, _piece, run
from tracepp.split.naming import starred

RTOL = 1e-6  # of the largest magnitude of the reference value: float64 sums in another order agree to ~1e-15
LIMIT = 50_000_000  # elements (parameters, buffers and inputs) of a stage run here; above it: not verified
ROUNDS = 4  # plans verified before a repair gives up
MODES = ("on", "strict", "off")



@dataclass
class Mismatch:
    stage: object  # the stage's index, or a label ("the loss")
    what: str  # "the value of mul_3", "the gradient of layers.0.attn.q.weight", "output 0"
    node: str = ""  # the op's node name in the stage graph
    op: str = ""  # its target, readable
    at: str = ""  # model.py:42, or ''
    error: float = 0.0
    scale: float = 0.0
    fqns: list = field(default_factory=list)  # the sharded parameters feeding it: made whole by a repair
    failed: str = ""  # the error where the rewritten program does not run on the ranks' values

    def text(self) -> str:
        where = f" ({self.op}{' at ' + self.at if self.at else ''})" if self.op else ""
        how = (f"by {self.error:.3g} (largest magnitude {self.scale:.3g})" if self.error != float("inf") else
               "in its shape, its integer values or where it is finite")
        label = f"stage {self.stage}" if isinstance(self.stage, int) else self.stage
        if self.failed:
            return f"{label}: {self.what}{where} fails on the ranks' values ({self.failed})"
        return f"{label}: {self.what}{where} differs from the unsharded graph {how}"


# ---- snapshots of the stage graphs before the rewrite

def snapshot(graph) -> tuple:
    """What ``tensor_parallel.apply`` changes: each stage graph and each boundary value's shape."""
    return ([copy.deepcopy(stage.graph) for stage in graph.stages],
            {name: list(value.meta.shape) for name, value in graph.values.items()})


def restore(graph, saved: tuple) -> None:
    """The stage graphs as :func:`snapshot` saw them (a fresh copy: the snapshot stays as it was)."""
    graphs, shapes = saved
    for stage, g in zip(graph.stages, graphs):
        stage.graph = copy.deepcopy(g)
    for name, shape in shapes.items():
        graph.values[name].meta.shape = list(shape)


# ---- inputs

def _hint(value) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is None:
            raise NotVerified(f"a size ({value}) has no example value")
        return int(hint)
    return int(value)


def _concrete(val) -> list:
    return [_hint(s) for s in val.shape]


def _random_like(val, generator) -> torch.Tensor:
    shape = _concrete(val)
    if val.dtype.is_floating_point or val.dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=_float64(val.dtype))
    if val.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.zeros(shape, dtype=val.dtype)


def _state_tensor(traced, ref):
    """The model's own tensor for a state reference (None where it is on meta or not found)."""
    model = traced.model
    for getter in (model.get_parameter, model.get_buffer):
        try:
            tensor = getter(ref.fqn)
        except (AttributeError, TypeError):
            continue
        return None if tensor.is_meta else tensor
    tensor = getattr(traced.program, "constants", {}).get(ref.fqn)
    return None if tensor is None or getattr(tensor, "is_meta", True) else tensor


def _root_value(traced, ref, val, start: int = 0):
    """The example batch's leaf, cut to the traced microbatch (its first samples; from sample ``start`` on: another
    replica's microbatch)."""
    leaves = traced.example_leaves
    if ref.leaf_index >= len(leaves) or not isinstance(leaves[ref.leaf_index], torch.Tensor):
        return None
    tensor = leaves[ref.leaf_index]
    shape = _concrete(val)
    if ref.batched and tensor.dim() and tensor.shape[0] >= start + shape[0]:
        tensor = tensor[start:start + shape[0]]
    return tensor if list(tensor.shape) == shape and not tensor.is_meta else None


def _cast(t):
    return t.detach().to(_float64(t.dtype)) if t.is_floating_point() or t.is_complex() else t.detach()


# ---- comparison

def _differs(have, want):
    """(error, scale) where ``have`` is not ``want`` within RTOL, else None."""
    if not isinstance(want, torch.Tensor) or not isinstance(have, torch.Tensor):
        return None
    if have.shape != want.shape:
        return (float("inf"), 0.0)
    if want.is_complex() and have.is_complex():  # compared as their (real, imaginary) pairs
        have, want = torch.view_as_real(have.detach().resolve_conj()), torch.view_as_real(want.detach().resolve_conj())
    if not want.is_floating_point():
        return None if torch.equal(have, want) else (float("inf"), 0.0)
    have, want = have.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(have)):
        return (float("inf"), 0.0)
    if not finite.any():
        return None
    error = (have - want)[finite].abs().max().item()
    scale = want[finite].abs().max().item()
    return (error, scale) if error > RTOL * scale + 1e-12 else None


def _whole(walk, node, values, size):
    """The whole value of a rewritten ``node`` from its ranks' ``values``, or None where its placement is not
    known here (a partial sum before its all-reduce, a fused value with whole parts, a list of pieces)."""
    if (node in walk.roles or node in walk.sums or node in walk.mixed or node in walk.owned_splits
            or node in walk.loop_live or node in walk.partial):  # (a head of a loop: this rank's own)
        return None
    if node in walk.shard:
        if not all(isinstance(v, torch.Tensor) for v in values):
            return None
        dim, segs = walk.shard[node], walk.segs.get(node)
        if walk.kind.get(node) == "seq":
            groups = walk.groups_of(segs)
            return _join(values, dim, groups) if groups else None
        return tp_runtime.original_layout(torch.cat(values, dim=dim), dim, size, list(segs) if segs else None)
    return values  # replicated: every rank's own


def _first_difference(stage_index, original, rewritten_env, reference_env, walk, size, cp: int = 1):
    """The first value of the original graph, in order, whose ranks' values do not reassemble to the reference
    (with ``cp``: each cp rank's tp ranks to that cp rank's)."""
    nodes = {node.name: node for node in walk.graph.nodes}
    for node, c in ((node, c) for node in original.nodes for c in range(cp)):
        if node.op != "call_function" or node.name not in rewritten_env or node.name not in nodes:
            continue
        want = reference_env[node.name][c]
        if not isinstance(want, torch.Tensor) or not want.is_floating_point():
            continue
        here = _whole(walk, nodes[node.name], rewritten_env[node.name][c * size:(c + 1) * size], size)
        if here is None:
            continue
        for have in (here if isinstance(here, list) else [here]):
            found = _differs(have, want)
            if found:
                mine = nodes[node.name]
                # an input that is a partial reduction all-reduced as a sum (not compared: its ranks hold parts) is
                # where the value went wrong: name that op
                culprit = _partial_input(mine, walk, {n.name for n in original.nodes})
                named = culprit if culprit is not None else mine
                return Mismatch(stage_index, f"the value of {node.name}", named.name, _op(named),
                                _where(named) or _where(node), found[0], found[1], _feeding(walk, mine))
    return None


def _first_gradient_difference(stage_index, original, rewritten_env, reference_env, walk, size, cp: int = 1):
    """The last value of the original graph, in order, whose gradient the ranks' do not reassemble to the reference's
    (every value's gradient kept by both runs): the op reading it gave it a wrong one. A shard's gradient is joined as
    the value is; a whole value's is each rank's, or the ranks' sum where the plan carries parts of it
    (``tp_grads.holding``); a value whose gradient is not known here (partial sums, fused parts) is passed over."""
    from tracepp.split import tp_grads

    nodes = {node.name: node for node in walk.graph.nodes}
    holding = tp_grads.holding(walk)
    for node in reversed(list(original.nodes)):
        if node.op != "call_function" or node.name not in rewritten_env or node.name not in nodes:
            continue
        mine = nodes[node.name]
        for c in range(cp):
            want = reference_env[node.name][c]
            ranks = rewritten_env[node.name][c * size:(c + 1) * size]
            if not isinstance(want, torch.Tensor) or want.grad is None or not all(
                    isinstance(v, torch.Tensor) and v.grad is not None for v in ranks):
                continue
            grads = [v.grad for v in ranks]  # (a value holding parts is whole, never a shard)
            have = sum(grads[1:], grads[0]) if mine in holding else _whole(walk, mine, grads, size)
            for item in ([] if have is None else have if isinstance(have, list) else [have]):
                found = _differs(item, want.grad)
                if found:
                    return Mismatch(stage_index, f"the gradient of {node.name}", mine.name, _op(mine), _where(mine),
                                    found[0], found[1], _feeding(walk, mine))
    return None


def _partial_input(node, walk, original_names: set):
    """The partial reduction (``walk.sums``) ``node`` reads, through the collectives the rewrite put after it."""
    queue = list(node.all_input_nodes)
    while queue:
        item = queue.pop(0)
        if item in walk.sums or item in walk.late_sums:
            return item
        if item.name not in original_names:  # inserted by the rewrite: look through it
            queue.extend(item.all_input_nodes)
    return None


def _op(node) -> str:
    target = node.target
    return getattr(target, "__name__", None) if not hasattr(target, "name") else str(target)


def _where(node) -> str:
    from tracepp.split.rules import where
    return where(node)


def _feeding(walk, node, limit: int = 200) -> list:
    """The sharded parameters whose pieces make ``node``: the column-wise weights its sharded inputs come from
    (``walk.origin``), else the sharded parameters upstream of it, nearest first."""
    found: dict = {}
    for item in [node] + list(node.all_input_nodes):
        for fqn in sorted(walk.origin.get(item, ())):  # a set: in name order, the same in every process
            found[fqn] = True
    if found:
        return list(found)
    seen, queue = set(), [node]
    while queue and len(seen) < limit:
        item = queue.pop(0)
        if item in seen:
            continue
        seen.add(item)
        fqn = walk.fqn_of.get(item.name) if item.op == "placeholder" else None
        if fqn is not None and item in walk.shard:
            found[fqn] = True
        for fqn in sorted(walk.origin.get(item, ())):
            found[fqn] = True
        if found:
            return list(found)
        queue.extend(item.all_input_nodes)
    return list(found)


# ---- one plan

def verify(graph, saved: tuple, tp_plan, walks, traced, training: bool = True, cp: int = 1) -> dict:
    """Run every stage as planned against its snapshot (:func:`snapshot`; with ``cp`` > 1 the cp-rewritten stages,
    run for every cp rank); returns {"status": "verified" | "mismatch" | "not verified", "why", "mismatch":
    Mismatch or None, "stages": per stage what was done}."""
    size = tp_plan.size
    originals, _shapes = saved
    generator = torch.Generator().manual_seed(0)
    sent = tp_plan.sent
    values: dict = {}  # boundary value name -> its whole value (from the unsharded run)
    done, seen = [], {}
    if getattr(traced, "random_ops", None):
        return {"status": "not verified", "why": f"the model draws random numbers ({traced.random_ops[0]}): the "
                                                 f"ranks' draws differ from one process's", "mismatch": None,
                "stages": []}
    for stage, original, walk in zip(graph.stages, originals, walks):
        try:
            result = _verify_stage(graph, stage, original, walk, size, traced, values, sent, generator, seen,
                                   training, tp_plan.params, cp)
        except NotVerified as error:
            result = {"status": "not verified", "why": str(error)}
        except Exception as error:  # an op that does not run here: say so, do not fail the split
            result = {"status": "not verified", "why": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        done.append(result)
        if result.get("mismatch") is not None:
            return {"status": "mismatch", "why": result["mismatch"].text(), "mismatch": result["mismatch"],
                    "stages": done}
        if result["status"] == "not verified":
            break  # the later stages' inputs are not known
    skipped = [f"stage {i}: {r['why']}" for i, r in enumerate(done) if r["status"] == "not verified"]
    if skipped or len(done) < len(graph.stages):
        return {"status": "not verified", "why": "; ".join(skipped) or "not run", "mismatch": None, "stages": done}
    return {"status": "verified", "why": "", "mismatch": None, "stages": done}


class Inputs:
    """A stage's inputs for both runs: per placeholder of the graph before the rewrite its whole value (float64)
    and whether its gradient is compared; ``received``: placeholder name -> boundary value name."""

    def __init__(self, graph, stage, original, traced, values: dict, generator, training: bool):
        placeholders = [n for n in original.nodes if n.op == "placeholder"]
        first = len(stage.state) + len(stage.root_inputs)
        self.received = {placeholders[first + i].name: name for i, (_p, name) in enumerate(stage.received)}
        state = dict(zip([n.name for n in placeholders], stage.state))
        roots = dict(zip([n.name for n in placeholders[len(stage.state):]], stage.root_inputs))
        count = sum(_prod(_concrete(n.meta["val"])) for n in placeholders
                    if isinstance(n.meta.get("val"), torch.Tensor))
        if count > LIMIT:
            raise NotVerified(f"{count / 1e6:.0f}M elements of parameters and inputs, more than the "
                              f"{LIMIT / 1e6:.0f}M run here")
        self.tensors, self.wanted = [], []
        for node in placeholders:
            val = node.meta.get("val")
            if node.name in state:
                ref = graph.state[state[node.name]]
                tensor = _state_tensor(traced, ref)
                tensor = _cast(tensor) if tensor is not None else _random_like(val, generator)
                wants = ref.kind == "parameter" and ref.trainable and tensor.is_floating_point() and training
            elif node.name in roots:
                tensor = _root_value(traced, graph.root_inputs[roots[node.name]], val)
                tensor = _cast(tensor) if tensor is not None else _random_like(val, generator)
                wants = False
            elif node.name in self.received:
                name = self.received[node.name]
                if name not in values:
                    raise NotVerified(f"{name} was not computed")
                tensor = values[name]  # with cp: a list over the cp ranks
                probe = tensor[0] if isinstance(tensor, list) else tensor
                wants = graph.values[name].meta.requires_grad and probe.is_floating_point() and training
            elif isinstance(val, torch.Tensor):
                tensor, wants = _random_like(val, generator), False
            else:
                tensor, wants = _hint(val) if val is not None else None, False
            self.tensors.append(tensor)
            self.wanted.append(wants)


def reference(original, inputs: list, wanted: list, names: list, values: dict, generator, seeds=None, cp: int = 1,
              size: int = 1, retain=()):
    """The unsharded run of ``original`` on ``inputs`` (the whole values; a gradient kept where ``wanted``) and its
    backward from random output gradients (``seeds(outputs)``: given ones). Sets ``values`` of the outputs
    ``names``; returns (leaves, env, outputs, output gradients). With ``cp`` > 1 ``original`` is a cp-rewritten
    graph run for every cp rank (an input: a list of the cp ranks' values, or one value for all), and each of
    leaves, outputs, gradients and ``values`` is a list over the cp ranks (with ``size`` > 1: over ``size`` x
    ``cp`` ranks, as :func:`run`'s grid). ``retain``: names of values whose gradients are kept (``.grad``)."""
    count = size * cp
    per = [t if isinstance(t, list) else [t] * count for t in inputs]
    leaves = [[x.clone().requires_grad_(w) if isinstance(x, torch.Tensor) else x for x in xs]
              for xs, w in zip(per, wanted)]
    env = run(original, leaves, size, cp)
    outputs = [list(out) for out in env[original.output_node().name]]
    for index, name in enumerate(names):
        got = [out[index].detach() if isinstance(out[index], torch.Tensor) else out[index] for out in outputs]
        values[name] = got if count > 1 else got[0]
    if seeds is not None:
        seeds = [seeds(out) for out in outputs]
    else:
        seeds = [[torch.randn(o.shape, generator=generator, dtype=o.dtype)
                  if isinstance(o, torch.Tensor) and o.requires_grad else None for o in out] for out in outputs]
    pairs = [(o, g) for out, gs in zip(outputs, seeds) for o, g in zip(out, gs) if g is not None and o.requires_grad]
    for value in (v for name in retain for v in env.get(name, ())):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.retain_grad()
    if pairs:
        torch.autograd.backward([o for o, _g in pairs], [g for _o, g in pairs])
    if count == 1:
        return [xs[0] for xs in leaves], env, outputs[0], seeds[0]
    return leaves, env, outputs, seeds


def _verify_stage(graph, stage, original, walk, size, traced, values, sent, generator, seen, training,
                  plan_params, cp: int = 1, locate: bool = False) -> dict:
    """One stage's tp rewrite against ``original``; with ``cp`` > 1 ``original`` is the cp-rewritten stage, run for
    every cp rank, and the rewrite for every (tp, cp) pair (tp rank t of cp rank c at ``c * size + t``), each cp
    rank's tp ranks compared with that cp rank's run. A gradient that differs where every value of the forward
    agrees is located by running the stage again on the same inputs (``locate``: every value's gradient kept) and
    comparing the values' gradients, last first (:func:`_first_gradient_difference`)."""
    from tracepp.split import blocks

    state = generator.get_state()  # to run the stage again on the same inputs, where a gradient alone differs
    inputs = Inputs(graph, stage, original, traced, values, generator, training)
    received = inputs.received
    kept = [n.name for n in original.nodes if n.op == "call_function"] if locate else ()
    leaves, reference_env, outputs, out_grads = reference(original, inputs.tensors, inputs.wanted, stage.outputs,
                                                          values, generator, cp=cp, retain=kept)
    if cp == 1:  # every value a list over the cp ranks from here on
        leaves, outputs, out_grads = [[leaf] for leaf in leaves], [outputs], [out_grads]
    signature = blocks.graph_signature(original)
    if signature in seen:
        return {"status": "verified", "why": f"the same graph as stage {seen[signature]}"}
    pairs = [g for gs in out_grads for g in gs if g is not None]
    # the ranks' run
    rewritten = [n for n in walk.graph.nodes if n.op == "placeholder"]
    ranked = []
    # cut from the inputs as they were before the reference run: its leaves hold what it wrote into them in place
    # (a buffer counted up: ``calls.add_(1)``, torchtitan's ``tokens_per_expert.add_``)
    untouched = [t if isinstance(t, list) else [t] * cp for t in inputs.tensors]
    for node, tensors, wants in zip(rewritten, untouched, inputs.wanted):
        if not isinstance(tensors[0], torch.Tensor):
            ranked.append([tensors[0]] * size * cp)
            continue
        fqn = walk.fqn_of.get(node.name)
        entry = plan_params.get(fqn) or {}
        name = received.get(node.name)
        pieces = []
        for tensor in (t.detach() for t in tensors):
            if entry.get("dim") is not None:
                pieces += [tp_runtime.shard(tensor, entry["dim"], size, r, entry.get("segments"))
                           for r in range(size)]
            elif name in sent:
                pieces += [_piece(tensor, sent[name], _sent_groups(walk, node), size, r) for r in range(size)]
            else:
                pieces += [tensor.clone() for _ in range(size)]
        ranked.append([p.detach().clone().requires_grad_(wants) for p in pieces])
    try:
        env = run(walk.graph, ranked, size, cp)
    except NotVerified:
        raise
    except Exception as error:  # the unsharded program ran: the plan is wrong at this op
        node = getattr(error, "verify_node", None)
        if node is None or node.op != "call_function":
            raise
        return {"status": "mismatch", "mismatch": Mismatch(
            stage.index, f"the value of {node.name}", node.name, _op(node), _where(node), float("inf"), 0.0,
            _feeding(walk, node), failed=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")}
    if locate:
        for value in (v for vs in env.values() if isinstance(vs, list) for v in vs):
            if isinstance(value, torch.Tensor) and value.requires_grad and not value.is_leaf:
                value.retain_grad()
    result_outputs = env[walk.graph.output_node().name]
    mismatch = None
    for c in range(cp):
        for index, (name, want) in enumerate(zip(stage.outputs, outputs[c])):
            have = [result_outputs[c * size + r][index] for r in range(size)]
            if _sends(walk, index):
                have = [_join(have, sent[name], _sent_groups_out(walk, index))]
            for item in have:
                found = _differs(item, want)
                if found:
                    made = list(walk.graph.output_node().args[0])[index]
                    mismatch = Mismatch(stage.index, f"output {name}" + (f" at cp rank {c}" if cp > 1 else ""),
                                        error=found[0], scale=found[1],
                                        fqns=_feeding(walk, made) if isinstance(made, fx.Node) else [])
                    break
            if mismatch:
                break
        if mismatch:
            break
    if mismatch is None and pairs:
        grads = []
        for c in range(cp):
            for index, (name, g) in enumerate(zip(stage.outputs, out_grads[c])):
                if g is None:
                    continue
                for r in range(size):
                    o = result_outputs[c * size + r][index]
                    grads.append((o, _piece(g, sent[name], _sent_groups_out(walk, index), size, r)
                                  if _sends(walk, index) else g))
        torch.autograd.backward([o for o, _g in grads], [g for _o, g in grads])
        for node, tensors, pieces, wants in zip(rewritten, leaves, ranked, inputs.wanted):
            if not wants:
                continue
            fqn = walk.fqn_of.get(node.name)
            entry = plan_params.get(fqn) or {}
            name = received.get(node.name)
            for c, leaf in enumerate(tensors):
                got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in pieces[c * size:(c + 1) * size]]
                want = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                if entry.get("dim") is not None:
                    got = [tp_runtime.original_layout(torch.cat(got, dim=entry["dim"]), entry["dim"], size,
                                                      entry.get("segments"))]
                elif entry.get("grad") == "partial":  # each rank's part, summed when the step ends (tp_grads)
                    got = [sum(got[1:], got[0])]
                elif name in sent:
                    got = [_join(got, sent[name], _sent_groups(walk, node))]
                found = next((f for f in map(lambda item: _differs(item, want), got) if f), None)
                if found:
                    what = f"the gradient of {fqn}" if fqn else f"the gradient of input {name or node.name}"
                    mismatch = Mismatch(stage.index, what + (f" at cp rank {c}" if cp > 1 else ""), error=found[0],
                                        scale=found[1], fqns=[fqn] if fqn and entry.get("dim") is not None else [])
                    break
            if mismatch:
                break
    if mismatch is not None:
        first = _first_difference(stage.index, original, env, reference_env, walk, size, cp)
        if first is None and mismatch.what.startswith("the gradient"):  # the forward agrees: locate it backward
            if not locate:
                generator.set_state(state)
                return _verify_stage(graph, stage, original, walk, size, traced, values, sent, generator, seen,
                                     training, plan_params, cp, locate=True)
            first = _first_gradient_difference(stage.index, original, env, reference_env, walk, size, cp)
        if first is not None:
            first.what = f"{first.what} (and so {mismatch.what})"
            mismatch = first
        return {"status": "mismatch", "mismatch": mismatch}
    seen[signature] = stage.index
    return {"status": "verified", "why": ""}


def _sent_groups(walk, node) -> int:
    segments = (walk.received.get(node.name) or (None, None))[1]
    return walk.groups_of(segments) or 1


def _sends(walk, index) -> bool:
    """The stage's output ``index`` leaves it as a shard (``walk.sends``). Not known by its name: a value received
    sharded and passed on to the model's outputs (PEFT's prefix cache of layer 0, output by the last stage) is
    gathered there, though the name is sent sharded by the stage before."""
    return list(walk.graph.output_node().args[0])[index] in walk.sends


def _sent_groups_out(walk, index) -> int:
    node = list(walk.graph.output_node().args[0])[index]
    segments = (walk.sends.get(node) or (None, None))[1]
    return walk.groups_of(segments) or 1


def _prod(items) -> int:
    out = 1
    for item in items:
        out *= item
    return out


# ---- the split's step

def _share_from(tp_plan, graph) -> float:
    numel: dict = {}
    for stage in graph.stages:
        names = [n for n in stage.graph.nodes if n.op == "placeholder"][:len(stage.state)]
        for node, ref_name in zip(names, stage.state):
            ref = graph.state[ref_name]
            if ref.kind == "parameter":
                numel[ref.fqn] = _prod(_concrete(node.meta["val"])) * (
                    tp_plan.size if (tp_plan.params.get(ref.fqn) or {}).get("dim") is not None else 1)
    total = sum(numel.values())
    sharded = sum(n for fqn, n in numel.items() if (tp_plan.params.get(fqn) or {}).get("dim") is not None)
    return sharded / total if total else 0.0


def single_threaded(run):
    """``run()`` on one torch thread, the count restored after: the verification's ops are tiny (two threads spin
    15x longer on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run()
    finally:
        torch.set_num_threads(threads)


def refused_or_recorded(flag: str, size: int, result: dict, started: float, why_wrong: str) -> tuple:
    """A plan verified without repair (cp, ep): a mismatch refuses the split naming the op (``why_wrong``: what
    the fault would be); else (the record for the manifest, notes for the user)."""
    if result["status"] == "mismatch":
        raise ValueError(f"--{flag} {size}: the plan does not compute what the model does: "
                         f"{result['mismatch'].text()}. Fix: split without --{flag} (or report it: {why_wrong}); "
                         f"--verify off writes the plan unchecked")
    record = {"status": result["status"], "why": result.get("why", ""),
              "seconds": round(time.perf_counter() - started, 3),
              "ran": [r["what"] + (f" ({r['why']})" if r.get("why") else "") for r in result["stages"]]}
    notes = [f"--{flag} {size}: the plan was not verified: {record['why']}"] if record["status"] == "not verified" \
        else []
    return record, notes


def verify_and_repair(graph, saved: tuple, tp_plan, walks, traced, replan, mode: str = "on",
                      training: bool = True, cp: int = 1) -> tuple:
    """Verify the applied plan; on a mismatch (``mode`` "on") make the parameters feeding the first differing
    value whole, ``replan(extra)`` ({fqn: "replicate"} added to the model file's tp_plan: returns the applied
    (tp_plan, walks)), and verify again; ``strict`` raises. Returns (tp_plan, walks, the record for the manifest,
    notes for the user)."""
    started = time.perf_counter()
    repairs, notes, extra = [], [], {}
    for _round in range(ROUNDS):
        result = single_threaded(lambda: verify(graph, saved, tp_plan, walks, traced, training, cp))
        if result["status"] != "mismatch":
            break
        mismatch = result["mismatch"]
        # a repeated block's parameter: its copies in every block (the same plan in each) made whole at once
        fix = list(dict.fromkeys(starred(fqn) for fqn in mismatch.fqns))
        fix = [pattern for pattern in fix if pattern not in extra]
        if mode == "strict" or not fix:
            entries = ", ".join(f"{fqn!r}: 'replicate'" for fqn in fix[:2])
            how = (f"make {', '.join(fix[:4])} whole (tp_plan = {{{entries}}} in the model file), or split with "
                   f"--verify on to let the split do it" if fix else "split without --tp, or report it")
            raise ValueError(f"--tp {tp_plan.size}: the plan does not compute what the model does: "
                             f"{mismatch.text()}. Fix: {how}")
        before = _share_from(tp_plan, graph)
        extra.update({fqn: "replicate" for fqn in fix})
        tp_plan, walks = replan(dict(extra))
        after = _share_from(tp_plan, graph)
        op = f"{mismatch.op}{' at ' + mismatch.at if mismatch.at else ''}" or mismatch.what
        repairs.append({"op": mismatch.op, "at": mismatch.at, "value": mismatch.what, "made_whole": fix,
                        "share_before": round(before, 4), "share_after": round(after, 4)})
        notes.append(f"--tp {tp_plan.size}: verification found {mismatch.text()}; made {', '.join(fix[:4])}"
                     f"{' and more' if len(fix) > 4 else ''} whole for {op}: parameters sharded {before:.1%} -> "
                     f"{after:.1%}")
    else:
        result = {"status": "not verified", "why": f"still differs after {ROUNDS} repairs"}
    record = {"status": "repaired" if repairs and result["status"] == "verified" else result["status"],
              "why": result.get("why", ""), "seconds": round(time.perf_counter() - started, 3)}
    if repairs:
        record["repairs"] = repairs
    if record["status"] == "not verified":
        notes.append(f"--tp {tp_plan.size}: the plan was not verified: {record['why']}")
    return tp_plan, walks, record, notes
