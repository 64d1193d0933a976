"""One op of a stage graph spelled as the ops it computes, where a planner can place those ops and not the whole.

A ``layer_norm``, ``rms_norm`` or ``linalg_vector_norm`` over a dim that tensor parallelism shards (torchscale's
Magneto sub-LayerNorm over the attention's heads before ``out_proj`` and over the FFN's hidden before ``fc2``; a
LayerNorm over a column-wise projection's features) is one op no rank can compute on its piece: the plan gathers
its input. Written out, it is a mean over the dim (a partial sum each rank adds up: one all-reduce of
``[b, s, 1]``), elementwise ops, a second mean, and the weight and bias each rank holds its piece of.
``tensor_parallel.plan`` prices both plans and keeps the cheaper (a LayerNorm whose output a linear then reads as
rows would all-reduce that linear's whole output instead). A p-norm (``F.normalize``'s: x-transformers' RMSNorm as
NormFormer's norm inside the MLP) is a partial sum of ``|x|^p`` and its root: torch's ``_NormPartial``, as ops every
planner places.

A recurrent cell (``gru_cell``, ``rnn_tanh_cell``, ``rnn_relu_cell``: x-transformers' ``GRUCell`` gate in place of
the residual add) is two linears and the gates' elementwise ops (:func:`cell`): written out, tensor parallelism
places its weights as any fused projection's (each rank its hidden units of the reset, update and new gates).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tracepp.split import rules
from tracepp.split.cost import _fake_mode_of
from tracepp.split.rules import val as _val

aten = torch.ops.aten
NORMS = (aten.layer_norm.default, aten.rms_norm.default, aten.linalg_vector_norm.default)
_HALF = (torch.float16, torch.bfloat16)


def norms(g: fx.Graph, names: set) -> dict:
    """The norms of ``g`` named in ``names`` written out (:func:`norm`): {name: the nodes made for it}."""
    return {node.name: norm(g, node) for node in list(g.nodes) if node.name in names and node.target in NORMS}


def norm(g: fx.Graph, node) -> list:
    """Replace ``node`` (``aten.layer_norm``, ``aten.rms_norm`` or ``aten.linalg_vector_norm``) by the ops it
    computes, as torch's reference decomposition does (in float32 for a half input, cast back): ``(x - mean) *
    rsqrt(var + eps) * weight + bias``, ``x * rsqrt(mean(x^2) + eps) * weight`` or ``sum(|x|^p) ^ (1/p)``. Returns
    the nodes made, the last standing for its output."""
    if node.target is aten.linalg_vector_norm.default:
        return _vector_norm(g, node)
    x = node.args[0]
    layer = node.target is aten.layer_norm.default
    weight = rules.arg(node, 2, "weight")
    bias = rules.arg(node, 3, "bias") if layer else None
    eps = rules.arg(node, 4 if layer else 3, "eps")
    dtype = _val(x).dtype
    if eps is None:  # layer_norm's default, or rms_norm's: the machine epsilon of the dtype it computes in
        eps = 1e-5 if layer else torch.finfo(torch.float32 if dtype in _HALF else dtype).eps
    dims = list(range(-rules.last_dims(node), 0))

    made_all, op = _maker(g, node)
    with g.inserting_before(node):
        h = op(aten.to.dtype, x, torch.float32) if dtype in _HALF else x
        if layer:
            mean = op(aten.mean.dim, h, dims, True)
            h = op(aten.sub.Tensor, h, mean)
        var = op(aten.mean.dim, op(aten.mul.Tensor, h, h), dims, True)
        out = op(aten.mul.Tensor, h, op(aten.rsqrt.default, op(aten.add.Tensor, var, eps)))
        if weight is not None:
            out = op(aten.mul.Tensor, out, weight)
        if bias is not None:
            out = op(aten.add.Tensor, out, bias)
        if _val(out).dtype != _val(node).dtype:
            out = op(aten.to.dtype, out, _val(node).dtype)
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return made_all


def order(node):
    """The order ``p`` of a ``linalg_vector_norm`` this module writes out (finite and positive), else None."""
    p = rules.arg(node, 1, "ord", 2)
    return p if isinstance(p, (int, float)) and 0 < p < float("inf") else None


def _vector_norm(g: fx.Graph, node) -> list:
    """``linalg_vector_norm(x, p, dims, keepdim, dtype=)``: ``sum(|x|^p over dims) ^ (1/p)`` in the dtype it
    computes in (``dtype``, else float32 for a half input), cast back. Where the sum is 0 the root is taken of 1 and
    the result set to 0 (``where`` twice), so that its gradient is 0 there as torch's is, not 0 / 0."""
    x, p = node.args[0], order(node)
    if p is None:
        raise ValueError(f"{node.name}: a vector norm of order {rules.arg(node, 1, 'ord', 2)} is not a sum")
    dims = rules.arg(node, 2, "dim") or list(range(_val(x).dim()))
    keep = bool(rules.arg(node, 3, "keepdim", False))
    dtype = node.kwargs.get("dtype") or (torch.float32 if _val(x).dtype in _HALF else None)
    made_all, op = _maker(g, node)
    with g.inserting_before(node):
        h = op(aten.to.dtype, x, dtype) if dtype is not None and dtype != _val(x).dtype else x
        powered = op(aten.mul.Tensor, h, h) if p == 2 else op(aten.abs.default, h) if p == 1 else op(
            aten.pow.Tensor_Scalar, op(aten.abs.default, h), p)
        total = op(aten.sum.dim_IntList, powered, list(dims), keep)
        if p == 1:
            out = total
        else:
            zero = op(aten.eq.Scalar, total, 0)
            safe = op(aten.where.ScalarSelf, zero, 1.0, total)
            root = op(aten.sqrt.default, safe) if p == 2 else op(aten.pow.Tensor_Scalar, safe, 1.0 / p)
            out = op(aten.where.ScalarSelf, zero, 0.0, root)
        if _val(out).dtype != _val(node).dtype:
            out = op(aten.to.dtype, out, _val(node).dtype)
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return made_all


CELLS = (aten.gru_cell.default, aten.rnn_tanh_cell.default, aten.rnn_relu_cell.default)
CELL_NAMES = ("gru_cell", "rnn_tanh_cell", "rnn_relu_cell")  # as rules.op_name names them: the written-out ops' mark


def of_cell(node) -> bool:
    """``node`` is an op of a recurrent cell written out (:func:`cell` marks them)."""
    return node.meta.get("written_out") in CELL_NAMES


def cells(g: fx.Graph) -> list:
    """Every recurrent cell of ``g`` over rows (a 2-D input) written out (:func:`cell`): the nodes made."""
    made = []
    for node in list(g.nodes):
        if node.op == "call_function" and node.target in CELLS and _val(node.args[0]).dim() == 2:
            made += cell(g, node)
    return made


def cell(g: fx.Graph, node) -> list:
    """Replace the cell ``node`` (``input, hx, w_ih, w_hh, b_ih, b_hh``) by what ATen's CPU cell computes:
    ``gi = linear(x, w_ih, b_ih)``, ``gh = linear(h, w_hh, b_hh)``; a GRU's gates the three chunks of each,
    ``r = sigmoid(gi_r + gh_r)``, ``z = sigmoid(gi_z + gh_z)``, ``n = tanh(gi_n + r * gh_n)``, the new state
    ``(h - n) * z + n``; an RNN cell's ``tanh`` or ``relu`` of ``gi + gh``. Returns the nodes made."""
    x, h, w_ih, w_hh = node.args[:4]
    b_ih = rules.arg(node, 4, "b_ih")
    b_hh = rules.arg(node, 5, "b_hh")
    made_all, op = _maker(g, node)
    with g.inserting_before(node):
        gi = op(aten.linear.default, x, w_ih, b_ih)
        gh = op(aten.linear.default, h, w_hh, b_hh)
        if node.target is aten.gru_cell.default:
            ci, ch = op(aten.chunk.default, gi, 3, 1), op(aten.chunk.default, gh, 3, 1)
            i_r, i_z, i_n = (op(operator.getitem, ci, k) for k in range(3))
            h_r, h_z, h_n = (op(operator.getitem, ch, k) for k in range(3))
            reset = op(aten.sigmoid.default, op(aten.add.Tensor, h_r, i_r))
            update = op(aten.sigmoid.default, op(aten.add.Tensor, h_z, i_z))
            new = op(aten.tanh.default, op(aten.add.Tensor, i_n, op(aten.mul.Tensor, h_n, reset)))
            out = op(aten.add.Tensor, op(aten.mul.Tensor, op(aten.sub.Tensor, h, new), update), new)
        else:
            act = aten.tanh.default if node.target is aten.rnn_tanh_cell.default else aten.relu.default
            out = op(act, op(aten.add.Tensor, gi, gh))
    for made in made_all:  # plan_cost: Megatron has no plan for a layer gated by a cell
        made.meta["written_out"] = rules.op_name(node)
    node.replace_all_uses_with(out)
    g.erase_node(node)
    return made_all


def _maker(g: fx.Graph, node) -> tuple:
    """(the list of nodes made, ``op(target, *args, **kwargs)``: a node made before the insertion point with
    ``node``'s source location and its fake output)."""
    made_all = []

    def op(target, *args, **kwargs):
        made = g.call_function(target, args, kwargs)
        made_all.append(made)
        made.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                      "source_fn_stack")})
        made.meta["val"] = _fake(target, args, kwargs)
        return made

    return made_all, op


def _fake(target, args, kwargs):
    """The output's fake tensor, computed in the inputs' fake mode."""
    values = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = _fake_mode_of(values)
    if mode is None:
        return target(*values, **kwargs)
    with mode:
        return target(*values, **kwargs)
