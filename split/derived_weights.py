"""Weights derived from one parameter at every call, traced back to it: which dim of the parameter a linear's
claim on a dim of the weight it reads lands on, through the steps between them.

A linear's weight is often not the parameter itself: TransformerLens rearranges ``W_Q`` (``einops.rearrange(W_Q,
"h m d -> (h d) m")``), nGPT normalises every weight by a parametrization (``F.normalize(W, dim=-1)``), litgpt's LoRA
cuts ``lora_B.unsqueeze(-1)`` into its q, k and v parts with ``split``. :func:`_chain` finds the parameter such a
weight is computed from alone, :func:`_rearranged` traces a dim of the weight back to the parameter's (each step's
dim map: a copy or an elementwise op keeps it, a move or a view moves it, an expand or a norm over another dim keeps
it, a cut along it takes a segment) and :func:`blocking_step` names the step that mixes it. The tensor-parallel walk
(``tp_contract``, ``tp_walk._use``) claims the parameter there, and the steps run on this rank's piece.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.rules import equal as _equal, sizes as _sizes, val as _val

aten = torch.ops.aten

_REARRANGES = {aten.clone.default, aten.contiguous.default, aten.alias.default}  # copies: each element where it was
_CUTS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}  # a weight's parts, one dim kept
_DERIVED_STEPS = 32  # the most steps a derived weight is looked for through (nGPT's normalised weight: 5)


def _chain(node):
    """The parameter placeholder ``node`` is computed from on every call, alone, by ops that keep each index of some
    dim of it apart (:func:`_rearranged`): rearranged (TransformerLens's ``einops.rearrange(W_Q, "h m d -> (h d)
    m")``, ``W.T.contiguous()``, ``b.reshape(-1)``: transposes, permutes, views and copies) or normalised over
    another dim (nGPT's weights, ``F.normalize(W, dim=-1)`` by a parametrization: a norm over a dim, kept, its
    clamp, expanded back and divided into the weight); else None."""
    found = _chains(node)
    return next(iter(found)) if found is not None and len(found) == 1 else None


def _chains(node):
    """The placeholders ``node`` is computed from on every call by such ops (:func:`_chain`), one or several
    (KAN-GPT's ``spline_weight * spline_scaler.unsqueeze(-1)``: each index of the output and input dims kept apart in
    both), as a frozenset; else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    found, todo, seen = set(), [node], set()
    while todo:
        step = todo.pop()
        if step in seen:
            continue
        seen.add(step)
        if len(seen) > _DERIVED_STEPS:
            return None  # not a weight's own few steps (an activation's history: not walked, whatever its length)
        if step.op == "placeholder":
            found.add(step)
            continue
        if step.op != "call_function" or _derived_family(step) is None or not step.all_input_nodes:
            return None
        todo.extend(step.all_input_nodes)
    return frozenset(found) or None


def _derived_family(node):
    """The kind of step :func:`_chain` passes: "keep" (a copy, an elementwise op of one tensor), "move" (a transpose,
    an unsqueeze or a view), "binary", "expand", "reduce" (a reduction keeping its dims: a norm's), "cut" and "item"
    (a split of the weight into parts and one part: litgpt's ``lora_B.unsqueeze(-1).split(qkv_shapes)``); else
    None."""
    target = node.target
    if target in rules.MOVES or target in rules.VIEWS:
        return "move"
    if target in _CUTS:
        return "cut"
    if target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in _CUTS:
        return "item"
    if target in _REARRANGES:
        return "keep"
    if target in (aten.expand_as.default,) or target in rules.EXPANDS:
        return "expand"
    if target in (aten.max.dim, aten.min.dim):  # values alone read (``w.abs().max(dim=1).values``: a per-channel
        return "reduce" if values_only(node) else None  # scale), its indices would be of a rank's piece
    if target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in (
            aten.max.dim, aten.min.dim):
        return "keep" if node.args[1] == 0 else None
    if target in rules.PARTIAL:
        return "reduce"
    if target in rules.CASTS:  # a parameter's cast that linears read (a router's ``weight.float()``, DeepSeek-V4's
        # hyper-connection ``fn.float()``) is left as it was: whole. One read by further steps (``detach``; BitNet's
        # ``w.float()``, then scaled and rounded, in fp32 or from bf16), or of a step's value (BitNet's ``.to(dtype)``
        # back to the weight's bf16 after its rounding), is a copy
        source = node.args[0]
        direct = isinstance(source, fx.Node) and source.op == "placeholder"
        return None if direct and all(reads_as_weight(user, node) for user in node.users) else "keep"
    if rules.is_pointwise(target) or target in rules.UNARY or target in rules.BINARY:
        return "keep" if len(node.all_input_nodes) == 1 else "binary"
    return None


def values_only(node) -> bool:
    """A ``max(x, dim)`` or ``min(x, dim)`` whose indices nothing reads (they would be of a rank's piece)."""
    return all(user.target is operator.getitem and (user.args[1] == 0 or not user.users) for user in node.users)


_WHOLE_KINDS = {"sum", "mean", "max", "min"}  # reductions over a piece the ranks combine: an all-reduce sum, or MAX


def whole_scale(operand, out, dim: int):
    """``(reduction, steps, its input's dim)`` where ``operand``, broadcast along ``dim`` of ``out`` (a step of a
    derived weight), is a reduction over that dim of a value of the weight's, through steps of one whole value
    after it (BitNet's ternary weights: ``1 / w.abs().mean().clamp(min=1e-5)`` scales ``w``): each rank reduces its
    piece and the ranks' results are combined (:data:`_WHOLE_KINDS`); else None."""
    steps, node = [], operand
    while isinstance(node, fx.Node) and node.op == "call_function" and _derived_family(node) != "reduce":
        if _derived_family(node) not in ("keep", "move") or len(node.all_input_nodes) != 1:
            return None
        steps.append(node)
        node = node.all_input_nodes[0]
    if not (isinstance(node, fx.Node) and node.op == "call_function") or rules.PARTIAL[node.target] not in _WHOLE_KINDS:
        return None
    if node.kwargs.get("dtype") is not None:
        return None
    before = dim - (out.dim() - _val(node.args[0]).dim())
    if before < 0 or before not in rules.reduction(node)[0]:
        return None
    return node, steps, before


def steps_of(end) -> list:
    """The steps between a derived weight ``end`` (:func:`_chain`) and its parameter, ``end`` first, the
    placeholder last."""
    order, todo = [], [end]
    while todo:
        node = todo.pop()
        if node in order:
            continue
        order.append(node)
        if node.op != "placeholder":
            todo.extend(node.all_input_nodes)
    order.sort(key=lambda n: n.op == "placeholder")
    return order


def dim_before(node, dim: int, tp: int):
    """The dim of ``node``'s input whose indices are its output's ``dim``: moved by a transpose or permute, or
    split or merged by a view that keeps each piece of it whole; None where no one dim is."""
    in_val, out_val = _val(node.args[0]), _val(node)
    if node.target in rules.MOVES:
        found = [e for e in range(in_val.dim()) if rules.moved_dim(node, e, tp) == dim]
    elif node.target in rules.VIEWS:  # the input dim whose pieces the view makes this dim's
        found = [e for e in range(in_val.dim())
                 if rules.view_placement(_sizes(in_val), _sizes(out_val), e, None, tp) == (dim, None)]
    else:
        return None
    return found[0] if len(found) == 1 else None


def _rearranged(node, dim: int, tp: int):
    """[(node, dim), ..., (placeholder, its dim)]: ``dim`` of a weight derived from one parameter (:func:`_chain`)
    traced back step by step to the parameter's dim whose pieces it holds (:func:`dim_before`; a copy or an
    elementwise op keeps its dims, an expand or a broadcast operand its dim where it is not of size 1, a reduction
    the dim it does not reduce over); None where no one dim does, or where one step would need two. A reduction over
    the dim whose result scales the weight (:func:`whole_scale`) and the steps after it are on the way with dim None:
    computed whole from the ranks' pieces."""
    return _traced(node, dim, tp)[0]


def blocking_step(node, dim: int, tp: int):
    """The step of a derived weight's way (:func:`_rearranged`) that mixes the indices of ``dim`` (a norm over it),
    or None where the way passes."""
    return _traced(node, dim, tp)[1]


def _traced(node, dim: int, tp: int):
    """(:func:`_rearranged`'s way or None, the step where it stops or None)."""
    at, todo = {}, [(node, dim)]
    while todo:
        step, d = todo.pop()
        if step in at:
            if at[step] != d:
                return None, step
            continue
        at[step] = d
        if step.op == "placeholder":
            continue
        kind, out = _derived_family(step), _val(step)
        if kind == "keep":
            todo.append((step.all_input_nodes[0], d))
        elif kind == "move":
            before = dim_before(step, d, tp)
            if before is None:
                return None, step
            todo.append((step.args[0], before))
        elif kind in ("expand", "binary"):
            operands = [step.args[0]] if kind == "expand" else step.all_input_nodes
            for operand in operands:  # expand_as's second operand gives its shape alone
                e = d - (out.dim() - _val(operand).dim())
                if e < 0 or _equal(_val(operand).shape[e], 1) and not _equal(out.shape[d], 1):
                    found = whole_scale(operand, out, d) if kind == "binary" else None
                    if found is None:
                        return None, _reduced_from(operand) or step  # broadcast along the dim: computed across it
                    reduction, whole, before = found  # a reduction of the rank's piece, combined: whole after it
                    for value in [reduction] + whole:
                        if at.get(value, None) is not None:
                            return None, value
                        at[value] = None
                    todo.append((reduction.args[0], before))
                    continue
                todo.append((operand, e))
        elif kind in ("cut", "item"):  # a part of the weight: the same dim, a segment of it where it is cut there
            todo.append((step.args[0], d))
        elif kind == "reduce":
            before = [e for e in range(_val(step.args[0]).dim()) if rules.reduced_dim(step, e) == d]
            if len(before) != 1:
                return None, step
            todo.append((step.args[0], before[0]))
        else:
            return None, step
    way = sorted(at.items(), key=lambda item: item[0].op == "placeholder")
    if way[-1][0].op == "placeholder":  # (with several parameters, each placeholder's dim is on the way)
        return way, None
    return None, node


def _reduced_from(node):
    """The reduction a value broadcast back along a dim was computed by (a norm's ``linalg_vector_norm``, through its
    clamp and its view), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if _derived_family(node) == "reduce":
            return node
        if len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return None


def reads_as_weight(user, end) -> bool:
    """``user`` reads ``end`` as a linear's weight or bias, a 1 x 1 convolution's weight or one operand of an einsum of
    two, and not as its input."""
    if user.target is aten.linear.default:
        return end in user.args[1:3] and end is not user.args[0]
    if user.target is aten.einsum.default:  # one of two operands (CoLT5's per-route weight): the other an activation
        operands = list(user.args[1])
        return len(operands) == 2 and operands.count(end) == 1
    return user.target is aten.conv1d.default and end is user.args[1] and end is not user.args[0]


def cut_segments(way, segments, tp: int):
    """{split: its parts' sizes} where a derived weight's way (:func:`_rearranged`) takes one part of its parameter
    cut along the traced dim (litgpt's ``lora_B.unsqueeze(-1).split(qkv_shapes)``): the parameter is then held in
    those segments, each part this rank's piece of its own. ``{}`` where no split cuts that dim; False where one
    cannot be read so (two cuts, parts ``tp`` does not divide, a weight already claimed in segments)."""
    found = {}
    for step, at in way:
        if step.op == "call_function" and step.target in rules.SPLITS and rules.cut_dim(step) == at:
            sizes = [v.shape[at] for v in _val(step)]
            if segments or found or not rules.ints(sizes) or any(int(size) % tp for size in sizes):
                return False
            found[step] = tuple(int(size) for size in sizes)
    return found


def sizes_kept(way, cut) -> bool:
    """Every value on a derived weight's way is as long along its traced dim as the parameter's dim, or as one of the
    parts it is cut into (no view regroups the dim, whose segments then would not be the parameter's)."""
    placeholder, at = way[-1]
    allowed = {int(_val(placeholder).shape[at])} | {size for sizes in cut.values() for size in sizes}
    return all(not isinstance(_val(step), torch.Tensor) or d is None or int(_val(step).shape[d]) in allowed
               for step, d in way)
