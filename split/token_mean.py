"""A loss that is a mean over the tokens its target does not ignore, weighted across microbatches as eager weighs it.

``F.cross_entropy(logits, labels)`` averages over the tokens whose label is not ``ignore_index`` (-100 unless the
call says otherwise: padding, a prompt left out of the loss). Eager computes that mean once over the whole batch. A
pipeline computes it per microbatch, and weighing each microbatch's mean by its share of the samples gives eager's
loss only when every microbatch holds the same share of the counted tokens: padding spread unevenly over the
microbatches (or over the data-parallel replicas) moved the gradient, with no word (issue 57, PaLM-rlhf-pytorch's
``ignore_index=0``).

At split, :func:`find` follows the loss back from its value, through the model file's ``loss_fn`` (traced,
``tracepp/trace_loss.py``) and, where that returns an output of the model, the model's own graph, through steps
that only scale it (a constant factor, a cast), to one ``cross_entropy``/``nll_loss`` with ``reduction='mean'``
and no class weights; then its target back, through slices along other dims than the batch's and ops that keep
every element (views, permutes, copies, integer casts), to one batched input of the model or one leaf of the
target. The result is plain data for the manifest's ``token_mean``::

    {"source": "input" | "target", "leaf": 3, "slices": [[1, 1, 9223372036854775807, 1]], "ignore_index": -100,
     "op": "cross_entropy_loss at model.py:516"}

and the runtime (``runtime/batching.py``, ``token_counts``) counts each microbatch's tokens from it, before the step,
and weighs each microbatch's loss by its share of the batch's counted tokens (over every replica) rather than of its
samples.

A mean over ignored tokens that cannot be followed so (class weights, a second loss term added to it, a target
computed from the model's values) is named in a warning at split: the pipelined loss weighs its microbatches by
samples there. Imports torch only.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tracepp.split import rules

aten = torch.ops.aten

_SCALES = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default}
_SHAPES = rules.VIEWS | rules.FLATTENS | rules.MOVES  # every element kept, dims regrouped or moved
_WHOLE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.sum.default, aten.mean.default}  # of a scalar: the scalar


def _is_mean(node) -> bool:
    """A mean over the tokens not ignored: a ``cross_entropy`` or ``nll_loss`` over class indices (over
    probabilities, soft labels, it is a mean over every element, which samples weigh)."""
    if not (node.op == "call_function" and node.target in rules.IGNORE_INDEX):
        return False
    target = rules.val(node.args[1]) if len(node.args) > 1 else None
    floating = isinstance(target, torch.Tensor) and target.dtype.is_floating_point
    return not floating and rules.arg(node, rules.LOSSES[node.target][1], "reduction", 1) == 1


def _scalar_step(node):
    """The one value ``node`` scales, or None: a product or quotient by a number, a negation, a copy or cast, a
    view or reduction of a scalar."""
    if node.op != "call_function":
        return None
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if len(tensors) != 1:
        return None
    if node.target in _SCALES:
        return node.args[0] if node.args[0] is tensors[0] or node.target is aten.mul.Tensor else None
    value = rules.val(tensors[0])
    if node.target in rules.CASTS or (node.target in _WHOLE and isinstance(value, torch.Tensor) and value.dim() == 0):
        return tensors[0]
    return None


class _Stages:
    """The stage graphs read as one: a received value's placeholder stands for the node its producer outputs."""

    def __init__(self, graph):
        from tracepp.runtime.shapes import activation_key

        self.sent = {}
        for stage in graph.stages:
            made = stage.graph.output_node().args[0]
            outputs = dict(zip(stage.outputs, made)) if stage.index < len(graph.stages) - 1 else {}
            self.sent.update({(stage.index, name): node for name, node in outputs.items()})
        self.received = {}
        for stage in graph.stages:
            by_name = {n.name: n for n in stage.graph.nodes if n.op == "placeholder"}
            for producer, name in stage.received:
                node = by_name.get(activation_key(name, producer))
                if node is not None and (producer, name) in self.sent:
                    self.received[node] = self.sent[(producer, name)]

    def source(self, node):
        """The node a received placeholder stands for (as often as it was passed on), else ``node``."""
        while node in self.received:
            node = self.received[node]
        return node

    def reaching(self, start) -> set:
        seen, todo = set(), [start]
        while todo:
            node = self.source(todo.pop())
            if isinstance(node, fx.Node) and node not in seen:
                seen.add(node)
                todo.extend(node.all_input_nodes)
        return seen


def _loss_value(loss):
    """The loss graph's one output."""
    out = loss.graph.output_node().args[0]
    return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


def _leaf_node(loss, graph, node):
    """The last stage's node for the model output leaf a loss placeholder stands for, or None."""
    index = loss.inputs.get(node.name) if node.op == "placeholder" else None
    if index is None or graph.output_leaves[index][0] != "value":
        return None
    return graph.stages[-1].graph.output_node().args[0][index]


def _means_reaching(loss, graph, stages: _Stages) -> list:
    """Every token mean the loss value is computed from, in the loss graph or, through an output leaf it reads, in
    the model's stage graphs."""
    found = []
    for node in stages.reaching(_loss_value(loss)):
        leaf = _leaf_node(loss, graph, node)
        found += [n for n in ([node] if leaf is None else stages.reaching(leaf)) if _is_mean(n)]
    return found


def _pads(node, ignore):
    """``[(left, right)]`` per dim, the last dim first, of a constant pad that adds ``ignore`` alone, or None."""
    if node.target is aten.constant_pad_nd.default:
        pad, value = node.args[1], rules.arg(node, 2, "value", 0)
    elif node.target is aten.pad.default and rules.arg(node, 2, "mode", "constant") == "constant":
        pad, value = node.args[1], rules.arg(node, 3, "value", None)
    else:
        return None
    if value is None or value != ignore or not all(isinstance(p, int) for p in pad):
        return None
    return [(pad[i], pad[i + 1]) for i in range(0, len(pad), 2)]


def _unpadded(slices: list, pads: list, shape) -> bool:
    """Move ``slices`` (of a padded tensor of ``shape``) to the tensor before its ignored padding: the elements the
    pad added are ignored, so only where a slice starts and ends among the others matters. False where it cannot
    be read so (a step, a size that changes)."""
    for entry in slices:
        dim, start, end, step = entry
        rank = len(shape)
        dim = dim % rank
        left = pads[rank - 1 - dim][0] if rank - 1 - dim < len(pads) else 0
        size = shape[dim]
        if step != 1 or not isinstance(size, int):
            return False
        start = 0 if start is None else (start + size if start < 0 else start)
        end = size if end is None else (end + size if end < 0 else min(end, size))
        entry[:] = [dim, max(start - left, 0), max(end - left, 0), 1]
    return True


def _target_source(node, loss, roots: dict, batch_dim: int, stages: _Stages):
    """(source, leaf, slices) of the token mean ``node``'s target, or a reason it cannot be followed."""
    value, slices, sliced = stages.source(node.args[1]), [], False
    ignore = rules.arg(node, rules.IGNORE_INDEX[node.target], "ignore_index", -100)
    while isinstance(value, fx.Node) and value.op == "call_function":
        pads = _pads(value, ignore)
        if pads is not None:  # Hugging Face's labels padded by one ignored token, then shifted
            if not _unpadded(slices, pads, list(rules.val(value).shape)):
                return f"its target is sliced after a pad ({rules.op_name(value)}{rules.at(value)})"
        elif value.target is aten.slice.Tensor:
            dim, start, end, step = (list(value.args[1:]) + [0, None, None, 1][len(value.args) - 1:])[:4]
            if not all(isinstance(x, int) or x is None for x in (dim, start, end, step)):
                return f"its target is sliced at sizes that change ({rules.op_name(value)}{rules.at(value)})"
            slices.append([int(dim), start, end, int(step)])
            sliced = True
        elif value.target in _SHAPES:
            if sliced:
                return f"its target is sliced after a reshape ({rules.op_name(value)}{rules.at(value)})"
        elif value.target not in rules.CASTS:
            return (f"its target is computed ({rules.op_name(value)}{rules.at(value)}), not read from an input or "
                    f"the target")
        dtype = getattr(rules.val(value), "dtype", None)
        if dtype is not None and dtype.is_floating_point:
            return f"its target is a floating tensor ({rules.op_name(value)}{rules.at(value)})"
        value = stages.source(value.args[0])
    if not isinstance(value, fx.Node) or value.op != "placeholder":
        return "its target is not an input of the model or a leaf of the target"
    if loss is not None and value.name in loss.inputs:
        if loss.inputs[value.name] is not None:
            return "its target is an output of the model"
        targets = [n for n in loss.graph.nodes if n.op == "placeholder" and loss.inputs.get(n.name) is None]
        source, leaf = "target", targets.index(value)
    elif value.name in roots:
        if not roots[value.name].batched:
            return f"its target ({roots[value.name].path}) is not cut along the batch"
        source, leaf = "input", roots[value.name].leaf_index
    else:
        return "its target is not an input of the model or a leaf of the target"
    rank = rules.val(value).dim() if isinstance(rules.val(value), torch.Tensor) else None
    for entry in slices:
        entry[0] = entry[0] % rank if rank else entry[0]
        if entry[0] == batch_dim:
            return "its target is sliced along the batch dim"
    return source, leaf, slices[::-1]  # in the order they apply, from the leaf


def find(loss, graph) -> tuple:
    """``(token_mean or None, warning or None)`` for the traced loss ``loss`` (a ``LossGraph``; None: no loss
    traced) of the stage graphs ``graph`` (a ``PipelineGraph`` before any rewrite; module docstring)."""
    if loss is None:
        return None, None
    stages = _Stages(graph)
    means = _means_reaching(loss, graph, stages)
    if not means:
        return None, None
    named = ", ".join(sorted({f"{rules.op_name(n)}{rules.at(n)}" for n in means}))
    node = _loss_value(loss)
    while isinstance(node, fx.Node) and not _is_mean(node):
        node = _leaf_node(loss, graph, node) or _scalar_step(stages.source(node))
        node = stages.source(node) if isinstance(node, fx.Node) else node
    reason = None
    if len(means) > 1 or node not in means:
        reason = "the loss is not one such mean times a constant"
    elif rules.arg(node, rules.LOSSES[node.target][0], "weight") is not None:
        reason = "it weighs classes (its count is the ignored tokens' weights)"
    else:
        found = _target_source(node, loss, graph.root_inputs, graph.batch_dim, stages)
        if isinstance(found, tuple):
            source, leaf, slices = found
            ignore = rules.arg(node, rules.IGNORE_INDEX[node.target], "ignore_index", -100)
            return {"source": source, "leaf": leaf, "slices": slices, "ignore_index": int(ignore),
                    "op": f"{rules.op_name(node)}{rules.at(node)}"}, None
        reason = found
    return None, (f"the loss is a mean over the tokens its target does not ignore ({named}), and tracepp cannot count "
                  f"each microbatch's tokens: {reason}. Each microbatch's mean is weighed by its share of the "
                  f"samples, which is eager's loss only where every microbatch holds as many counted tokens per "
                  f"sample; pad every microbatch to as many counted tokens, or write the loss as one such mean whose "
                  f"target is an input or the target, sliced along other dims than the batch's (docs/guide.md, 'A "
                  f"loss over some tokens')")
