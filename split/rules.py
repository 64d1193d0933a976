"""The op rules every parallel plan reads: what each op computes, registered once, and where a value sharded on one
dim comes out of it.

tracepp places tensor parallelism (heads and features), sequence parallelism and context parallelism (positions) and
expert parallelism (rows) by walking a stage graph in order and asking, at every op, where a sharded input's dim
goes. That question has one answer per op whatever the mesh dimension is, and it is answered here:

* **families** (the sets below, and :data:`FAMILIES` / :func:`family`, the one key each op's rule is found by):
  what an op computes. Elementwise (casts, unary, binary, torch's pointwise tag), views and moves, reductions with
  the kind of partial result they leave over a sharded dim, contractions, attention in its spellings, gathers,
  scatters and indexing, ops along one dim (softmax, scans, sorts), norms, convolutions, factories, losses, and
  tracepp's own collectives. Every walk places an op by its family's method (``Propagation._rule``);
* **dim maps** (the functions): the output dim of a shard through a move (:func:`moved_dim`), a reduction
  (:func:`reduction`, :func:`partial_kind`), an op along a dim (:func:`along_dims`), a broadcast operand
  (:func:`aligned_dim`), a cut (:func:`cut_dim`), and a view (:func:`view_blocks`: heads, a fused projection's
  equal parts and a sequence's positions alike; :func:`view_placement` in tensor parallelism's segments).

The planners (``tensor_parallel``, ``context_parallel``, ``expert_parallel``) do not restate these: they choose the
seeds (which values start sharded), what a whole operand beside a shard becomes (cut to the rank's piece, read
whole with its gradient summed, or gathered) and what a rule's "no" costs; ``plan_cost`` prices the result and
``verify`` / ``verify_cp`` check it. ``tests/test_rules.py`` checks every dim map against torch running the op.
"""
from __future__ import annotations

import functools
import operator
import os

import sympy
import torch
import torch.fx as fx

from tracepp.split.naming import frames

aten = torch.ops.aten

# ---- families: what an op computes

IGNORED = {aten._assert_tensor_metadata.default}
CASTS = {  # one tensor in, the same values (or a copy) out
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
}
DROPOUTS = {aten.dropout.default, aten.bernoulli.p, aten.feature_dropout.default}
KEEP = CASTS | DROPOUTS | {aten.type_as.default}  # one tensor in, the same positions out
LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
        aten.rand_like.default, aten.randn_like.default}  # a new tensor of another's shape: placed as it is
UNARY = CASTS | {  # elementwise, one tensor in
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.neg.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar,
    aten.square.default, aten.abs.default, aten.erf.default, aten.dropout.default, aten.silu_.default,
    aten.gelu_.default, aten.relu_.default, aten.tanh_.default, aten.sigmoid_.default, aten.log.default,
    aten.reciprocal.default, aten.softplus.default, aten.leaky_relu.default, aten.clamp.default,
    aten.hardtanh.default, aten.sin.default, aten.cos.default, aten.mish.default, aten.elu.default,
    aten.log_sigmoid.default,  # F.logsigmoid (xLSTM's gates): torch does not tag it pointwise
    aten.real.default, aten.imag.default,  # a complex tensor's parts (views, untagged: gateloop's a_cumprod.real)
}
BINARY = {  # elementwise, broadcasting operands
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
    aten.minimum.default, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.add.Scalar,
    aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar,
    aten.add_.Tensor, aten.mul_.Tensor, aten.sub_.Tensor, aten.div_.Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.pow.Tensor_Tensor, aten.rsub.Scalar, aten.rsub.Tensor, aten.div.Tensor_mode,
}
_UNTAGGED_POINTWISE = {  # elementwise ops torch does not tag pointwise
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.__and__.Tensor, aten.__and__.Scalar,
    aten.__or__.Tensor, aten.__or__.Scalar, aten.__xor__.Tensor, aten.__xor__.Scalar, aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.fill_.Scalar,
    aten.fill_.Tensor, aten.copy_.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten.polar.default,  # torch.polar(abs, angle): a complex number per element (gateloop's gates)
}
_ALIASES = (  # numpy-style and torch.special names of pointwise ops, which torch does not tag (einx's
    #           ``einx.multiply`` calls ``torch.multiply``: x-transformers' per-head value gates)
    "multiply", "divide", "subtract", "greater", "greater_equal", "less", "less_equal", "not_equal", "negative",
    "absolute", "arccos", "arcsin", "arctan", "arctan2", "arccosh", "arcsinh", "arctanh", "fix", "special_expit",
    "special_exp2", "special_expm1", "special_log1p", "special_round", "special_sinc", "special_ndtr", "special_erf",
    "special_erfc", "special_erfinv", "special_i0", "special_logit", "special_xlogy")
_UNTAGGED_POINTWISE |= {getattr(getattr(aten, name), overload) for name in _ALIASES if hasattr(aten, name)
                        for overload in getattr(aten, name).overloads()
                        if "out" not in overload and not overload.endswith("_")}

VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
FLATTENS = {aten.flatten.using_ints}  # a view with no size list to rewrite
UNFLATTENS = {aten.unflatten.int}
EXPANDS = {aten.expand.default, aten.broadcast_to.default}
TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default, aten.mT.default,
              aten.mH.default, aten.adjoint.default}  # mT, mH, adjoint: the last two dims swapped (litgpt's k.mT)
COMPLEX_VIEWS = {aten.view_as_complex.default, aten.view_as_real.default}  # the last dim's pairs <-> complex numbers
MOVES = TRANSPOSES | COMPLEX_VIEWS | {  # the same elements, dims moved, added or dropped (:func:`moved_dim`)
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.movedim.int}
SLICES = {aten.slice.Tensor, aten.narrow.default, aten.select.int}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
TENSOR_SPLITS = {aten.tensor_split.sections, aten.tensor_split.indices}
CUTS = SPLITS | TENSOR_SPLITS  # several outputs, each a range of one dim
CATS = {aten.cat.default, aten.concatenate.default, aten.concat.default}  # (tensors, dim): cat's other names
STACKS = {aten.stack.default}
FRESH = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}  # (x, size)
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
FACTORIES = ARANGES | FRESH | {aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.full.default,
                               aten.scalar_tensor.default}

# reductions: what a reduction over the sharded dim leaves on each rank, a partial result of this kind
PARTIAL = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.nansum.default: "sum", aten.mean.dim: "mean",
    aten.mean.default: "mean", aten.nanmean.default: "nanmean", aten.count_nonzero.dim_IntList: "sum",
    aten.count_nonzero.default: "sum", aten.amax.default: "max", aten.amin.default: "min", aten.max.dim: "max",
    aten.min.dim: "min", aten.max.default: "max", aten.min.default: "min", aten.linalg_vector_norm.default: "norm",
    aten.norm.ScalarOpt_dim: "norm", aten.norm.Scalar: "norm", aten.linalg_norm.default: "norm", aten.prod.dim_int: "product",
    aten.prod.default: "product", aten.logsumexp.default: "logsumexp", aten.var.correction: "variance",
    aten.std.correction: "variance", aten.var_mean.correction: "variance", aten.std_mean.correction: "variance",
    aten.any.dim: "any", aten.any.dims: "any", aten.any.default: "any", aten.all.dim: "all", aten.all.dims: "all",
    aten.all.default: "all", aten.argmax.default: "arg", aten.argmin.default: "arg",
}
SUMMED = {"sum", "mean"}  # partial kinds combined by an all-reduce sum (a mean divided by the whole count)
REDUCTIONS_BY_DIM = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}  # (x, dims, keepdim)
NORMS = {aten.layer_norm.default: 1, aten.rms_norm.default: 1, aten.native_layer_norm.default: 1}  # shape arg
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
           aten._safe_softmax.default}

# contractions and attention
MATMULS = {aten.matmul.default, aten.bmm.default}  # batched: heads (or the batch) carried
MM = {aten.mm.default}
PRODUCTS = MATMULS | MM  # a @ b of 2-D or batched operands
CONTRACTIONS = MATMULS | MM | {aten.einsum.default}
BADDBMM = {aten.baddbmm.default}  # a bias plus a batched product (ALiBi scores)
SDPA = {aten.scaled_dot_product_attention.default}
ATTENTION_PRODUCTS = SDPA | MATMULS | BADDBMM | {aten.einsum.default}  # attention's products over the heads
ATTENTION_NORMALIZERS = SDPA | {aten._softmax.default, aten.softmax.int}

# along one dim, gathers, scatters, convolutions
SCANS = {aten.cumsum.default, aten.cumprod.default, aten.cummax.default, aten.cummin.default,
         aten.logcumsumexp.default}
SORTS = {aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable}
ALONG = SCANS | SORTS | SOFTMAX | {aten.flip.default, aten.unfold.default,  # work along one dim (:func:`along_dims`)
                                   aten.glu.default}  # nn.GLU: the dim's halves, one gating the other
CELLS = {aten.gru_cell.default, aten.rnn_tanh_cell.default, aten.rnn_relu_cell.default}  # (input, hx, weights...):
#       row by row over dim 0 (x-transformers' gate_residual: a GRUCell over the (b n) rows)
BAGS = {aten.embedding_bag.padding_idx, aten.embedding_bag.default, aten._embedding_bag.default}  # (weight,
#       indices, offsets, ..., per_sample_weights, ...): with 2-D indices each row one bag (product-key memory)
INDEXED_ALONG = {  # along one dim at an index tensor's positions (``(x, dim, index[, src])``)
    aten.gather.default, aten.scatter.value, aten.scatter.src, aten.scatter_.value, aten.scatter_.src,
    aten.scatter_add.default, aten.scatter_add_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two,
}
TRIANGLES = {aten.tril.default, aten.triu.default}  # (x, diagonal): over the last two dims
PADS = {aten.pad.default, aten.constant_pad_nd.default}  # (x, pad, ...): pad lists the last dims' (before, after)
WINDOWS = {aten.im2col.default}  # nn.Unfold of [N, C, H, W]: each sample's windows (native sparse attention's
#                                  compression of (b h) rows): over the last three dims
CONVS = {aten.conv1d.default, aten.conv2d.default}  # (input, weight, bias, stride, padding, dilation, groups)
CONVOLUTIONS = CONVS | {aten.conv3d.default, aten.convolution.default, aten.conv1d.padding, aten.conv2d.padding,
                        aten.conv_transpose1d.default}

LOSSES = {aten.cross_entropy_loss.default: (2, 3), aten.nll_loss.default: (2, 3),  # (weight, reduction) args
          aten.nll_loss_nd.default: (2, 3), aten.nll_loss2d.default: (2, 3), aten.mse_loss.default: (None, 2),
          aten.l1_loss.default: (None, 2), aten.smooth_l1_loss.default: (None, 2), aten.huber_loss.default: (None, 2),
          aten.binary_cross_entropy_with_logits.default: (2, 4), aten.binary_cross_entropy.default: (2, 3)}
IGNORE_INDEX = {aten.cross_entropy_loss.default: 4, aten.nll_loss.default: 4, aten.nll_loss_nd.default: 4,
                aten.nll_loss2d.default: 4}

# context parallelism's ops along the sequence (runtime/context_parallel.py): tensor parallelism walks the graphs cp
# rewrote, and a tp shard of another dim passes through them
CP_COLLECTIVES = ("tracepp::cp_shard", "tracepp::cp_all_gather", "tracepp::cp_reduce_scatter",
                  "tracepp::cp_all_reduce", "tracepp::cp_halo", "tracepp::cp_unhalo", "tracepp::cp_cumsum",
                  "tracepp::cp_logcumsumexp", "tracepp::cp_cumprod", "tracepp::cp_linear_scan",
                  "tracepp::cp_amax")  # (x, dim, ...): each works along its dim alone; cp_amax (x, dims, keepdim)
                                       # over dims


def is_pointwise(target) -> bool:
    """Elementwise: torch tags it pointwise, or it is one of the ops torch leaves untagged."""
    return target in _UNTAGGED_POINTWISE or torch.Tag.pointwise in getattr(target, "tags", ())


# ---- what an op computes: the one key every walk's rule is found by (``Propagation._rule``)

FAMILIES = (  # (family, its ops): the first family that lists an op is its own
    ("item", {operator.getitem}),  # one output of a multi-output op
    ("size", {aten.sym_size.int}),
    ("fresh", FRESH),  # a new tensor of given sizes made from another (its dtype and device)
    ("write", {aten.copy_.default}),  # a value written into another in place
    ("join", CATS | STACKS),
    ("dtype_of", {aten.type_as.default}),  # the second operand gives only its dtype
    ("norm", set(NORMS)),
    ("group_norm", {aten.group_norm.default}),  # over each sample's groups of channels (dim 1) and the dims after
    ("cast", CASTS | DROPOUTS),
    ("like", LIKE),
    ("attention", SDPA),
    ("product", PRODUCTS),
    ("biased_product", BADDBMM),
    ("einsum", {aten.einsum.default}),
    ("loss", set(LOSSES)),
    ("convolution", CONVOLUTIONS),
    ("indexed_along", INDEXED_ALONG),
    ("elementwise", UNARY | BINARY),  # and every op torch tags pointwise (:func:`family`)
    ("view", VIEWS | FLATTENS | UNFLATTENS),
    ("view_as", {aten.view_as.default, aten.reshape_as.default}),
    ("move", MOVES),
    ("expand", EXPANDS),
    ("expand_as", {aten.expand_as.default}),
    ("cut", SLICES | CUTS),
    ("index", {aten.index.Tensor}),
    ("repeat", {aten.repeat.default}),
    ("repeat_interleave", {aten.repeat_interleave.self_int}),
    ("reduction", set(PARTIAL)),
    ("along", ALONG),
    ("trailing", PADS | TRIANGLES | WINDOWS),
    ("linear", {aten.linear.default, aten.addmm.default}),
    ("cell", CELLS),
    ("bag", BAGS),
    ("lookup", {aten.embedding.default}),
)
_FAMILY = {op: name for name, ops in reversed(FAMILIES) for op in ops}  # earlier families overwrite later ones


def family(target) -> str:
    """What ``target`` computes, as ``FAMILIES`` names it; ``collective`` for tracepp's cp collectives, ``elementwise``
    for an op torch tags pointwise, ``other`` for the rest (torch's own rule, or a refusal)."""
    found = _FAMILY.get(target)
    if found is not None:
        return found
    if getattr(target, "name", lambda: "")() in CP_COLLECTIVES:
        return "collective"
    return "elementwise" if is_pointwise(target) else "other"


# ---- where in the model's source

_TORCH_DIR = os.path.dirname(torch.__file__)


def where(node) -> str:
    """``model.py:42``: the innermost frame of the node's stack trace outside torch (the model's own line, or its
    library's, e.g. ``modeling_llama.py:123``), or ''."""
    found = frames(node.meta.get("stack_trace")) if isinstance(node, fx.Node) else []
    outside = [f for f in found if _TORCH_DIR not in f[0] and f"{os.sep}torch{os.sep}" not in f[0]]
    frame = (outside or found or [None])[-1]
    return f"{os.path.basename(frame[0])}:{frame[1]}" if frame else ""


def at(node) -> str:
    """`` at model.py:42``, or '' where the node has no source line."""
    line = where(node)
    return f" at {line}" if line else ""


def op_name(node) -> str:
    """``scaled_dot_product_attention`` / ``split.Tensor``: an op as a message names it."""
    target = node.target
    return getattr(target, "__name__", str(target)) if not isinstance(target, torch._ops.OpOverload) else \
        f"{target._schema.name.split('::')[-1]}.{target._overloadname}".replace(".default", "")


# ---- shapes

def val(node):
    """The traced value (``meta["val"]``) of a node, or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def sizes(value) -> list:
    """A value's sizes: Python ints where static, sympy expressions where symbolic (the per-node path compares
    ints; algebra only where a dim is symbolic)."""
    return [symbolic(s.node.expr) if isinstance(s, torch.SymInt) else int(s) for s in value.shape]


def symbolic(expr):
    """An int for an integer expression, else the sympy expression."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else expr


def equal(a, b) -> bool:
    """Two sizes equal: ints, SymInts or sympy expressions (compared expanded, cached)."""
    if isinstance(a, torch.SymInt):  # a raw size of a value (val.shape[d]): its expression, hashable for the cache
        a = symbolic(a.node.expr)
    if isinstance(b, torch.SymInt):
        b = symbolic(b.node.expr)
    if isinstance(a, (int, sympy.Integer)) and isinstance(b, (int, sympy.Integer)):
        return int(a) == int(b)
    return _equal_symbolic(a, b)


@functools.lru_cache(maxsize=65536)
def _equal_symbolic(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def prod(items):
    out = 1
    for item in items:
        out = out * item
    return symbolic(out) if not isinstance(out, int) else out


def ints(items) -> bool:
    """Every size a (sympy) integer."""
    return all(isinstance(i, int) or sympy.sympify(i).is_Integer for i in items)


def components(items, links) -> list:
    """The groups of ``items`` joined by ``links`` (pairs of items), each in the order ``items`` gives them, the
    groups in the order of their first item."""
    parent = {item: item for item in items}

    def find(item):
        while parent[item] is not item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    for a, b in links:
        parent[find(a)] = find(b)
    groups: dict = {}
    for item in parent:
        groups.setdefault(find(item), []).append(item)
    return list(groups.values())


def arg(node, index: int, name: str, default=None):
    """Argument ``index`` of the node's call, or its keyword ``name``, or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def named(node, name: str, default=None):
    """The argument the op's schema calls ``name``, where the call gives it positionally or by keyword; ``default``
    where it gives neither or the schema has no such argument."""
    names = [spec.name for spec in node.target._schema.arguments]
    return arg(node, names.index(name), name, default) if name in names else default


# ---- dim maps: where a shard of ``dim`` goes through an op (None: the op reads across that dim)

def moved_dim(node, dim: int, ranks: int = 1):
    """The output dim of ``node.args[0]``'s dim ``dim`` through a move (:data:`MOVES`), or None where the op regroups
    that dim (a complex view of the last dim's pairs, a squeeze of it). ``ranks``: how many pieces the dim is cut
    into; a ``squeeze()`` of every size-1 dim would also drop a piece of size 1 (a dim of 2 over 2 ranks)."""
    target, first = node.target, node.args[0]
    ndim = val(first).dim()
    if target is aten.transpose.int:
        a, b = (d % ndim for d in node.args[1:3])
        return b if dim == a else a if dim == b else dim
    if target is aten.t.default:  # swaps a matrix's two dims (a vector's one stays)
        return ndim - 1 - dim if ndim == 2 else dim
    if target is aten.numpy_T.default:  # reverses every dim
        return ndim - 1 - dim
    if target in (aten.mT.default, aten.mH.default, aten.adjoint.default):  # the last two dims swapped
        return {ndim - 2: ndim - 1, ndim - 1: ndim - 2}.get(dim, dim)
    if target is aten.permute.default:
        return [d % ndim for d in node.args[1]].index(dim)
    if target is aten.movedim.int:
        order = list(range(ndim))
        src, dst = node.args[1] % ndim, node.args[2] % ndim
        order.insert(dst, order.pop(src))
        return order.index(dim)
    if target is aten.unsqueeze.default:
        where_ = node.args[1] % (ndim + 1)
        return dim + 1 if where_ <= dim else dim
    if target in COMPLEX_VIEWS:  # only the last dim regrouped: (re, im) pairs <-> complex numbers
        if target is aten.view_as_complex.default and dim == ndim - 1:
            return None
        return dim
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        shape = sizes(val(first))
        ats = (node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]) \
            if len(node.args) > 1 else list(range(ndim))
        ats = [a % ndim for a in ats if equal(shape[a % ndim], 1)]
        if dim in ats or (target is aten.squeeze.default and equal(shape[dim], ranks)):
            return None
        return dim - sum(1 for a in ats if a < dim)
    raise KeyError(f"{target} is not a move")


def reduction(node) -> tuple:
    """``(dims, keepdim)`` of a reduction (:data:`PARTIAL`): the input's dims it reduces (all where it names none),
    read by the op's schema (``dim`` and ``keepdim`` wherever the overload puts them)."""
    ndim = val(node.args[0]).dim()
    dims, keep = named(node, "dim"), named(node, "keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(ndim))
    elif not isinstance(dims, (list, tuple)):
        dims = [dims]
    return [d % ndim for d in dims], bool(keep)


def reduced_dim(node, dim: int):
    """Through a reduction: ``dim``'s place in the output where the reduction keeps it, or None where it reduces
    over ``dim`` (each rank then holds a partial result of :func:`partial_kind`)."""
    dims, keep = reduction(node)
    if dim in dims:
        return None
    return dim if keep else dim - sum(1 for d in dims if d < dim)


def partial_kind(node) -> str:
    """What a reduction over a sharded dim leaves on each rank: "sum"/"mean" (an all-reduce sum combines them),
    "max", "min", "norm" (a p-norm: the ranks' norms combine as a p-norm, not a sum), "product", "variance", ..."""
    kind = PARTIAL[node.target]
    if kind == "norm":
        order = named(node, "ord", named(node, "p", 2))
        if node.target is aten.linalg_norm.default:  # a vector norm over one dim, Frobenius over two (ord None);
            if order is None:                          # a matrix norm of an order is not one of the elements
                return "2-norm"
            if len(reduction(node)[0]) != 1:
                return "matrix norm"
        return f"{order:g}-norm" if isinstance(order, (int, float)) else "norm"
    return kind


def along_dims(node) -> list:
    """The dims an op along one dim works along (softmax's, a scan's, a sort's, top-k's, a gather's or scatter's,
    flip's (several), an unfold's windows), as non-negative indices of its input."""
    target = node.target
    ndim = val(node.args[0]).dim()
    if target is aten.flip.default:
        return [d % ndim for d in node.args[1]]
    if target is aten.topk.default:
        return [arg(node, 2, "dim", -1) % ndim]
    return [arg(node, 1, "dim", -1) % ndim]


def pointwise_convolution(node) -> bool:
    """A convolution whose kernel covers one position (1 x 1, stride 1, no padding, not transposed: x-transformers'
    talking heads, ``Conv2d(heads, heads, 1)`` over the scores): each output position reads its own input position."""
    weight = val(node.args[1])
    if node.target is aten.convolution.default:
        stride, padding, transposed = node.args[3], node.args[4], node.args[6]
    else:
        stride, padding, transposed = arg(node, 3, "stride", 1), arg(node, 4, "padding", 0), False
    ones = lambda v: all(int(x) == 1 for x in (v if isinstance(v, (list, tuple)) else [v]))  # noqa: E731
    zeros = padding in ("valid", "same") or all(int(x) == 0 for x in (padding if isinstance(padding, (list, tuple))
                                                                        else [padding]))
    kernel = list(weight.shape[2:])
    return not transposed and ints(kernel) and all(int(k) == 1 for k in kernel) and ones(stride) and zeros


def last_dims(node) -> int:
    """How many trailing dims an op reads across: a triangle's matrix (2), a pad's padded dims (to the outermost pair
    that is not (0, 0)), a norm's shape, an
    im2col's channels and windowed dims (3)."""
    if node.target in TRIANGLES:
        return 2
    if node.target in PADS:  # the dims up to the outermost one padded: (1, 1, 0, 0) pads the last dim alone
        pairs = [node.args[1][i:i + 2] for i in range(0, len(node.args[1]), 2)]
        return max((k + 1 for k, pair in enumerate(pairs) if any(not (isinstance(p, int) and p == 0) for p in pair)),
                   default=0)
    if node.target in NORMS:
        return len(node.args[1])
    if node.target in WINDOWS:  # channels and the two dims windowed; a sample's are its own
        return 3
    raise KeyError(f"{node.target} reads no trailing dims")


def pad_index(ndim: int, dim: int) -> int:
    """Where ``dim``'s ``(before, after)`` stands in a pad list (which lists the last dims first)."""
    return 2 * (ndim - 1 - dim)


def pad_pair(node, dim: int) -> tuple:
    """A pad's ``(before, after)`` for ``dim`` (``(0, 0)`` where the list stops before it)."""
    pad, at = node.args[1], pad_index(val(node.args[0]).dim(), dim)
    return tuple(pad[at:at + 2]) if at + 1 < len(pad) else (0, 0)


def pads_dim(node, dim: int) -> bool:
    """A pad's ``(before, after)`` for ``dim`` is not ``(0, 0)``: ``F.pad(x, (0, 0, 1, -1))`` pads dim -2 alone, and
    a shard of the last dim goes through it as it is."""
    return any(not (isinstance(p, int) and p == 0) for p in pad_pair(node, dim))


def conv1d_reach(node):
    """``(padding, reach)`` of a ``conv1d`` of stride 1 whose padding and dilation are ints: each output reads
    ``reach = dilation * (kernel - 1)`` positions past its first; None for any other convolution."""
    if node.target is not aten.conv1d.default:
        return None
    stride, padding, dilation = (
        value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        for value in (arg(node, 3, "stride", 1), arg(node, 4, "padding", 0), arg(node, 5, "dilation", 1)))
    if stride != 1 or not isinstance(padding, int) or not isinstance(dilation, int):
        return None
    return padding, dilation * (int(val(node.args[1]).shape[-1]) - 1)


def aligned_dim(out_ndim: int, out_dim: int, value):
    """The dim of a broadcasting operand ``value`` lined up with the output's ``out_dim`` (sizes align from the
    right), or None where the operand broadcasts along it (absent there, or of size 1)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    at_ = out_dim - (out_ndim - value.dim())
    if at_ < 0 or equal(value.shape[at_], 1):
        return None
    return at_


def cut_dim(node) -> int:
    """The dim a slice, narrow, select, split, chunk, unbind or tensor_split cuts (non-negative)."""
    target = node.target
    ndim = val(node.args[0]).dim()
    if target is aten.chunk.default:
        return arg(node, 2, "dim", 0) % ndim
    if target is aten.unbind.int:
        return arg(node, 1, "dim", 0) % ndim
    if target in SLICES:
        return arg(node, 1, "dim", 0) % ndim
    return arg(node, 2, "dim", 0) % ndim


def einsum_labels(node):
    """``(specs, output)`` of an ``einsum`` node (``"b h i d, b h j d -> b h i j"``: one label string per operand,
    one for the output), or None where the equation has no explicit output or a spec that does not name each of
    its operand's dims. An ellipsis is named out (xLSTM's headwise projection ``"...hd,hod->...ho"``): each
    operand's dims under it get labels of their own, lined up from the right as broadcasting lines them up."""
    equation, operands = node.args[0], list(node.args[1])
    if not isinstance(equation, str) or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    specs = inputs.split(",")
    if len(specs) != len(operands):
        return None
    if "..." in equation:
        spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
        counts = [val(arg).dim() - (len(spec) - 3) if "..." in spec else 0 for spec, arg in zip(specs, operands)]
        width = max(counts)
        if min(counts) < 0 or width > len(spare):
            return None
        named = spare[:width]
        specs = [spec.replace("...", "".join(named[width - k:])) for spec, k in zip(specs, counts)]
        output = output.replace("...", "".join(named))
    if any(len(spec) != val(arg).dim() for spec, arg in zip(specs, operands)):
        return None
    return specs, output


def kept_dim(node, dim: int):
    """Through a cut (:func:`cut_dim`) along another dim: ``dim``'s place in the output (in each output of a split,
    chunk or unbind), or None where the op cuts ``dim`` itself. A select or unbind drops the dim it cuts."""
    at_ = cut_dim(node)
    if at_ == dim:
        return None
    return dim - 1 if node.target in (aten.select.int, aten.unbind.int) and at_ < dim else dim


def joined_dim(node, dim: int):
    """Through a cat or stack (:data:`CATS`, :data:`STACKS`) of parts sharded on ``dim``: the output's dim, or None
    where a cat joins along ``dim`` (each rank's pieces would be side by side, not the whole's)."""
    at_ = arg(node, 1, "dim", 0) % val(node).dim()
    if node.target in STACKS:
        return dim + 1 if at_ <= dim else dim
    return None if at_ == dim else dim


def skipped_by_cat(part) -> bool:
    """A 1-D empty tensor, which ``torch.cat`` skips whatever the other parts' shapes (a cache that starts empty:
    XLM's keys)."""
    v = val(part)
    return isinstance(v, torch.Tensor) and v.dim() == 1 and equal(v.shape[0], 0)


def expanded_dim(node, dim: int) -> int:
    """Through an expand, ``broadcast_to`` or ``expand_as``: new dims come in front, so ``dim`` moves right by
    their count (the planner checks the expanded size there)."""
    return dim + val(node).dim() - val(node.args[0]).dim()


def indexed_dim(node, dim: int):
    """Through ``x[indices]`` (``aten.index.Tensor``) of an ``x`` sharded on ``dim``: where ``dim`` comes out, or
    None where an index reads it. Advanced indices (a bool mask reads as many dims as it has, making one) make
    their broadcast dims in place where they are adjacent, in front of every other dim where they are not."""
    indices = list(node.args[1])
    read, made = [], []  # input dims read by an index; dims each index makes
    p = 0
    for index in indices:
        if index is None:
            p += 1
            continue
        v = val(index)
        k = v.dim() if v.dtype == torch.bool else 1
        read.append(list(range(p, p + k)))
        made.append(1 if v.dtype == torch.bool else v.dim())
        p += k
    used = [d for dims in read for d in dims]
    if dim in used:
        return None
    if not used:
        return dim
    width = max(made)
    kept_before = sum(1 for d in range(dim) if d not in used)
    adjacent = all(read[i + 1][0] == read[i][-1] + 1 for i in range(len(read) - 1))
    if not adjacent:
        return width + kept_before
    return dim if dim < read[0][0] else kept_before + width


# ---- in-place writes

def drop_metadata_asserts(graph: fx.Graph) -> None:
    """Export records each ``x.to(dtype)`` with an ``_assert_tensor_metadata`` check of the traced dtype and
    device. A stage runs on another device, and under ``--precision bf16`` its autocast regions produce bf16
    where the trace saw fp32, so those checks would fail on correct values; they compute nothing, so they go (the
    rank script's stages, the memory count's, the cp-rewritten loss graph)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default \
                and not node.users:
            graph.erase_node(node)


def written(node) -> list:
    """The arguments ``node`` writes into, positional or keyword (an in-place op or an ``out=`` variant: its schema
    marks them written)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs[spec.name]
            for i, spec in enumerate(schema.arguments)
            if spec.alias_info is not None and spec.alias_info.is_write
            and (i < len(node.args) or spec.name in node.kwargs)]


_MAY_COPY = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten.contiguous.default}  # a view
#           only where they change nothing (their schema marks the output as maybe aliased): not taken for views


def is_view(node, copies: bool = False) -> bool:
    """``node``'s output is a view of its first operand: its schema says so (views, reshapes, slices, transposes,
    expands, squeezes, diagonals, ``alias``, ``detach``: ``Tensor(a) self -> Tensor(a)``), or it is ``_unsafe_view``,
    which export makes of a reshape and whose schema does not mark. A cast or ``contiguous`` is a view only where it
    changes nothing: taken for one with ``copies`` (what a write may reach: llama-models' ``self.cache_k =
    self.cache_k.to(xq)`` before it writes into the cache), not otherwise."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target in VIEWS:
        return True
    if node.target in _MAY_COPY:
        return copies
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write and schema.arguments
                and schema.arguments[0].alias_info is not None)


def written_roots(graph: fx.Graph) -> set:
    """The values ``graph`` writes into in place, each as the value its written view is a view of
    (:func:`view_root`)."""
    return {view_root(arg) for node in graph.nodes if node.op == "call_function"
            for arg in written(node) if isinstance(arg, fx.Node)}


def view_root(node, through_detach: bool = True):
    """The value ``node`` is a view of (:func:`is_view`, step by step): what an in-place write into ``node``
    changes. ``through_detach=False`` stops at a ``detach``: the tensor such a write gives a gradient to."""
    while is_view(node) and (through_detach or node.target is not torch.ops.aten.detach.default):
        node = node.args[0]
    return node


def writes(node) -> bool:
    """``node`` writes into one of its inputs."""
    return bool(written(node))


# ---- a view of pieces of a dim (tensor parallelism's heads, segments of a fused projection, a sequence shard's
# samples)

def boundaries(segments) -> list:
    """[0, s0, s0+s1, ...] of a segment list."""
    out, total = [0], 0
    for size in segments:
        total += int(size)
        out.append(total)
    return out


def _positive_int(expr) -> bool:
    expr = sympy.simplify(expr)
    return bool(expr.is_Integer) and int(expr) >= 1


def view_blocks(in_sizes: list, out_sizes: list, dim: int, groups, ranks: int, whole=1):
    """The view rule of every sharded dim: (output dim, its groups) of a dim holding ``groups`` equal blocks side by
    side (a fused projection's equal parts, the sequences of a batch merged into one dim), each cut into ``ranks``
    contiguous pieces of which a rank holds one per block, through a view from ``in_sizes`` to ``out_sizes``; None
    where a rank's pieces would not be the pieces of equal blocks of one output dim.

    The input is read as ``[outer, ranks, rest]`` (``outer``: the dims before times the blocks; ``rest``: a piece's
    elements times the dims after): output dim ``e`` holds the shard where the dims before it divide ``outer`` and the
    dims after it divide ``rest`` (sizes symbolic or not), the quotients its blocks and each rank's elements in them.
    ``whole``: a size that must stay in one dim with the rank's index (context parallelism: the rank's positions of
    a sequence, so the dim stays positions; tensor parallelism: 1, heads may split into heads and features). A piece
    kept whole (a rest that is a multiple of the piece: a symbolic sequence merged with the dims after it) always
    qualifies. Where it exists, ``e`` is the only such dim."""
    if ints(list(in_sizes) + list(out_sizes) + [groups, whole]):  # the common case, in Python's ints
        size, whole = int(in_sizes[dim]), int(whole)
        if size % (groups * ranks):
            return None
        outer, piece = int(prod(in_sizes[:dim])) * groups, size // (groups * ranks)
        rest = piece * int(prod(in_sizes[dim + 1:]))
        for e in range(len(out_sizes)):
            before, after = int(prod(out_sizes[:e])), int(prod(out_sizes[e + 1:]))
            if before and after and not outer % before and not rest % after:
                mine = rest // after
                if outer // before >= 1 and mine >= 1 and (not mine % whole or not mine % piece):
                    return e, outer // before
        return None
    size = sympy.sympify(in_sizes[dim])
    outer = sympy.sympify(prod(in_sizes[:dim])) * groups
    piece = size / (groups * ranks)
    rest = piece * prod(in_sizes[dim + 1:])
    for e in range(len(out_sizes)):
        blocks = sympy.simplify(outer / sympy.sympify(prod(out_sizes[:e])))
        mine = sympy.simplify(rest / sympy.sympify(prod(out_sizes[e + 1:])))
        if _positive_int(blocks) and (_positive_int(mine / whole) or _positive_int(mine / piece)):
            return e, int(blocks)
    return None


def view_placement(in_sizes: list, out_sizes: list, dim: int, segments, tp: int):
    """Tensor parallelism's view of a dim sharded with ``segments`` (None: one): (output dim, its segments or None),
    or None where the pieces would not stay whole. No segments or equal ones are :func:`view_blocks`' (the dim kept,
    split into heads with the sharded dim the outer part, merged with the dims after it or before it, a merged dim of
    one segment per outer index split back, heads merged with the dims before them: ``[batch, seq, heads * d] ->
    [batch * seq * heads, d]``); unequal ones (a fused projection's parts) are placed part by part."""
    if segments and len(segments) > 1 and len({sympy.sympify(p) for p in segments}) > 1:
        return _parts_view(in_sizes, out_sizes, dim, segments, tp)
    groups = len(segments) if segments else 1
    found = view_blocks(in_sizes, out_sizes, dim, groups, tp)
    if found is None:
        return None
    e, blocks = found
    if (e and equal(out_sizes[e - 1], 1) and _inner_units(out_sizes[:e]) > _inner_units(in_sizes[:dim])
            and not _widened(in_sizes[dim], out_sizes[e])):
        return None  # a dim of 1 put before the shard is a head count of one: the shard would cut inside the head
        #              (not where the shard is merged with the dims after it: fairseq's time-major
        #              [seq, batch * heads, d] -> [seq, batch, heads * d] at a batch of one keeps whole heads)
    if blocks == groups and equal(out_sizes[e], in_sizes[dim]):
        return e, segments  # kept
    if blocks == 1:
        return e, None
    block = sympy.simplify(sympy.sympify(out_sizes[e]) / blocks)
    return (e, (int(block),) * blocks) if block.is_Integer else None


def _parts_view(in_sizes: list, out_sizes: list, dim: int, segments, tp: int):
    """A dim of unequal parts through a view: kept, split (each part split alike, the sharded dim the outer part),
    or merged with the dims after it or before it (each part widened alike)."""
    size = in_sizes[dim]
    before = prod(in_sizes[:dim])
    starts = [e for e in range(len(out_sizes)) if equal(prod(out_sizes[:e]), before)]
    # size-1 dims give several candidates (a batch of one in front, a single head): the one that keeps as many
    # inner size-1 dims before the sharded dim as the input has (leading ones, a batch of one, do not count)
    units = _inner_units(in_sizes[:dim])
    same = [e for e in starts if _inner_units(out_sizes[:e]) == units]
    starts = ([e for e in same if not equal(out_sizes[e], 1)] or same
              or [e for e in starts if not equal(out_sizes[e], 1)])
    parts = list(segments)
    if not starts:
        return _merged_with_outer(in_sizes, out_sizes, dim, parts)
    for e in starts[:1]:
        out = out_sizes[e]
        if equal(out, size):
            return e, segments
        if not (ints([size, out]) and ints(parts)):
            return None
        size_i, out_i = int(size), int(out)
        if out_i < size_i and size_i % out_i == 0:  # split: the sharded dim is the outer part
            inner = size_i // out_i
            if any(int(p) % inner for p in parts):
                return None
            new = [int(p) // inner for p in parts]
            if any(p % tp for p in new):
                return None
            return e, tuple(new)
        if out_i > size_i and out_i % size_i == 0:  # merge: the sharded dim is the outer part
            inner = out_i // size_i
            return e, tuple(int(p) * inner for p in parts)
        return None
    return None


def indexed_rows(node):
    """(table, ids) of a 2-D value indexed on its rows by a stage input of integer ids, ``W_E[tokens, :]``
    (``aten.index``: TransformerLens's ``Embed``), an embedding spelled as indexing; else None. A table picked at
    indices the model computes (an expert's bias at its tokens' experts) is not an embedding."""
    if node.target is not torch.ops.aten.index.Tensor or len(node.args) != 2 or len(node.args[1]) != 1:
        return None
    table, (ids,) = node.args
    if not (isinstance(table, torch.fx.Node) and isinstance(ids, torch.fx.Node) and ids.op == "placeholder"):
        return None
    rows, index = val(table), val(ids)
    if not (isinstance(rows, torch.Tensor) and rows.dim() == 2 and isinstance(index, torch.Tensor)
            and not index.dtype.is_floating_point and index.dtype is not torch.bool):
        return None
    return table, ids


def _widened(size, out) -> bool:
    """``out`` is a multiple of ``size`` larger than it (a dim merged with the dims after it)."""
    ratio = sympy.sympify(out) / sympy.sympify(size)
    return bool(ratio.is_Integer and ratio > 1)


def _inner_units(sizes: list) -> int:
    """Size-1 dims after the first larger one (a single head, not a batch of one)."""
    first = next((i for i, s in enumerate(sizes) if not equal(s, 1)), len(sizes))
    return sum(1 for s in sizes[first:] if equal(s, 1))


def _merged_with_outer(in_sizes: list, out_sizes: list, dim: int, parts: list):
    """A sharded dim merged with the dims before it ([batch, seq] of tokens flattened to [batch * seq]): the
    merged dim holds one copy of the pieces per outer index, i.e. segments; None where the view does not merge."""
    size = in_sizes[dim]
    for e in range(len(out_sizes)):
        outer = prod(out_sizes[:e])
        for k in range(dim):
            if not equal(prod(in_sizes[:k]), outer):
                continue
            copies = prod(in_sizes[k:dim])
            if not ints([copies, size, out_sizes[e]] + parts) or int(copies) < 2:
                continue
            if int(out_sizes[e]) % (int(copies) * int(size)):
                continue
            inner = int(out_sizes[e]) // (int(copies) * int(size))
            if not any(equal(prod(in_sizes[dim + 1:dim + 1 + m]), inner) for m in range(len(in_sizes) - dim)):
                continue
            return e, tuple([int(p) * inner for p in parts] * int(copies))
    return None
