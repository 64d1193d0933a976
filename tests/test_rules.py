"""split/rules.py's dim maps checked against torch running the op: for every dim ``d`` of the input, where the rule
says a shard of ``d`` comes out on dim ``e``, each of two ranks running the op on its half of ``d`` holds exactly its
half of the whole op's output on ``e``; where it says the op reduces over ``d``, the ranks' partial results combine
into the whole one by the partial kind the rule names (a sum, a max, a p-norm...). No code shared with the rules:
only the op's own kernel."""
import math

import pytest
import torch
import torch.fx as fx

from tracepp.split import rules

aten = torch.ops.aten
SHAPE = (2, 4, 6, 8)
F64 = torch.float64  # the ranks' halves and the whole agree to rounding in float64


def _node(target, x, *args, **kwargs):
    """A one-op fx graph's op node, with the traced values as export records them (``meta["val"]``)."""
    g = fx.Graph()
    inputs = [g.placeholder(f"x{i}") for i in range(len(x))]
    for node, value in zip(inputs, x):
        node.meta["val"] = value
    node = g.call_function(target, (*inputs, *args), kwargs)
    node.meta["val"] = target(*x, *args, **kwargs)
    return node


def _halves(t, dim):
    return torch.chunk(t, 2, dim)


def _holds_with(op, x, dim, out_dim, same=torch.equal):
    """``op`` (a function of the input alone) on each rank's half of ``dim`` is that rank's half of the whole
    output (of each output, for a tuple) on ``out_dim``, compared by ``same``."""
    def pieces(out):
        return list(out) if isinstance(out, (list, tuple)) else [out]
    whole = pieces(op(x))
    for r, half in enumerate(_halves(x, dim)):
        try:
            local = pieces(op(half))
        except RuntimeError:  # the op cannot even run on a half (a norm's shape)
            return False
        for mine, w in zip(local, whole):
            piece = _halves(w, out_dim)[r]
            if mine.shape != piece.shape or not same(mine, piece):
                return False
    return True


def _holds(target, x, dim, out_dim, args, kwargs, out_index=None):
    """Each rank's op on its half of ``dim`` is its half of the whole output on ``out_dim`` (to float64 rounding)."""
    def op(t):
        out = target(t, *args, **kwargs)
        return out if out_index is None else out[out_index]
    return _holds_with(op, x, dim, out_dim, same=lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=0))


MOVES = [
    (aten.transpose.int, (1, 3), {}),
    (aten.transpose.int, (-1, 0), {}),
    (aten.permute.default, ([2, 0, 3, 1],), {}),
    (aten.movedim.int, (0, 2), {}),
    (aten.unsqueeze.default, (2,), {}),
    (aten.unsqueeze.default, (-1,), {}),
    (aten.numpy_T.default, (), {}),
    (aten.mT.default, (), {}),  # litgpt's q @ k.mT: refused under cp as "mixes the positions" before it had a rule
    (aten.mH.default, (), {}),
    (aten.adjoint.default, (), {}),
]


@pytest.mark.parametrize("target,args,kwargs", MOVES, ids=lambda v: str(v))
def test_a_moved_dim_is_where_torch_puts_it(target, args, kwargs):
    x = torch.randn(SHAPE, dtype=F64)
    node = _node(target, [x], *args, **kwargs)
    for dim in range(x.dim()):
        out_dim = rules.moved_dim(node, dim)
        assert out_dim is not None and _holds(target, x, dim, out_dim, args, kwargs), (target, dim, out_dim)


def test_squeezes_and_complex_views():
    x = torch.randn(2, 1, 6, 4, dtype=F64)
    for target, args in [(aten.squeeze.dim, (1,)), (aten.squeeze.dims, ([1, -1],)), (aten.squeeze.default, ())]:
        node = _node(target, [x], *args)
        for dim in (0, 2, 3):
            out_dim = rules.moved_dim(node, dim, ranks=2)
            if target is aten.squeeze.default and dim == 0:  # 2 over 2 ranks: each piece of size 1, squeezed too
                assert out_dim is None and rules.moved_dim(node, dim) == 0
                continue
            assert _holds(target, x, dim, out_dim, args, {}), (target, dim)
    pairs = torch.randn(2, 4, 6, 2, dtype=F64)
    node = _node(aten.view_as_complex.default, [pairs])
    for dim in range(3):
        assert _holds(aten.view_as_complex.default, pairs, dim, rules.moved_dim(node, dim), (), {})
    assert rules.moved_dim(node, 3) is None  # the (re, im) pairs themselves: regrouped
    numbers = torch.view_as_complex(pairs)
    node = _node(aten.view_as_real.default, [numbers])
    for dim in range(3):
        assert _holds(aten.view_as_real.default, numbers, dim, rules.moved_dim(node, dim), (), {})


ALONG = [
    (aten._softmax.default, (2, False), {}, None),
    (aten.cumsum.default, (1,), {}, None),
    (aten.sort.default, (-1,), {}, 0),
    (aten.topk.default, (2, 3), {}, 1),
    (aten.flip.default, ([0, 3],), {}, None),
    (aten.unfold.default, (3, 3, 1), {}, None),  # windows of 3 crossing the halves' boundary
]


@pytest.mark.parametrize("target,args,kwargs,out_index", ALONG, ids=lambda v: str(v))
def test_an_op_along_one_dim_carries_every_other_dim(target, args, kwargs, out_index):
    x = torch.randn(SHAPE, dtype=F64)
    node = _node(target, [x], *args, **kwargs)
    along = rules.along_dims(node)
    for dim in range(x.dim()):
        if dim in along:
            assert not _holds(target, x, dim, dim, args, kwargs, out_index), (target, dim)  # it does read across
        else:
            assert _holds(target, x, dim, dim, args, kwargs, out_index), (target, dim)


def test_a_gather_along_another_dim_with_its_index_halved_alike():
    x = torch.randn(SHAPE, dtype=F64)
    index = torch.randint(0, 8, SHAPE)
    g = fx.Graph()
    source, at = g.placeholder("x"), g.placeholder("index")
    source.meta["val"], at.meta["val"] = x, index
    node = g.call_function(aten.gather.default, (source, 3, at))
    assert rules.along_dims(node) == [3]
    whole = torch.gather(x, 3, index)
    for dim in range(3):
        for r, (xh, ih) in enumerate(zip(_halves(x, dim), _halves(index, dim))):
            assert torch.equal(torch.gather(xh, 3, ih), _halves(whole, dim)[r])


def test_trailing_dims_of_pads_triangles_and_norms():
    x = torch.randn(SHAPE, dtype=F64)
    for target, args, reads in [(aten.constant_pad_nd.default, ([1, 1, 2, 0],), 2), (aten.tril.default, (0,), 2),
                                (aten.layer_norm.default, ([6, 8],), 2), (aten.rms_norm.default, ([8],), 1)]:
        node = _node(target, [x], *args)
        assert rules.last_dims(node) == reads, target
        for dim in range(x.dim() - reads):
            assert _holds(target, x, dim, dim, args, {}), (target, dim)
        assert not _holds(target, x, x.dim() - 1, x.dim() - 1, args, {}), target
    # a pad reads across the dims it pads, up to the outermost pair that is not (0, 0); a (0, 0) pair keeps its dim's
    # shards (x-transformers' token shift, F.pad(t, (0, 0, 1, -1)), of features sharded under tp)
    for pad, reads, padded in [([1, 1, 0, 0], 1, [3]), ([0, 0, 1, -1], 2, [2]), ([0, 0, 0, 0, 2, 0], 3, [1])]:
        node = _node(aten.constant_pad_nd.default, [x], pad)
        assert rules.last_dims(node) == reads, pad
        for dim in range(x.dim()):
            assert rules.pads_dim(node, dim) == (dim in padded), (pad, dim)
            assert _holds(aten.constant_pad_nd.default, x, dim, dim, (pad,), {}) == (dim not in padded), (pad, dim)
    # nn.Unfold (im2col) of [N, C, H, W]: each sample's windows its own (dim 0 kept), its channels and windows mixed
    args = ([2, 3], [1, 1], [0, 1], [1, 2])  # kernel, dilation, padding, stride
    node = _node(aten.im2col.default, [x], *args)
    assert rules.last_dims(node) == 3 and rules.family(aten.im2col.default) == "trailing"
    assert _holds(aten.im2col.default, x, 0, 0, args, {})
    assert not _holds(aten.im2col.default, x, 3, 2, args, {})


def _combined(kind, parts, node):
    """The whole result from the ranks' partial results of ``kind``."""
    if kind in ("sum",):
        return parts[0] + parts[1]
    if kind == "max":
        return torch.maximum(*parts)
    if kind == "min":
        return torch.minimum(*parts)
    if kind.endswith("-norm"):
        p = float(kind[:-len("-norm")])
        return (parts[0] ** p + parts[1] ** p) ** (1 / p)
    if kind == "product":
        return parts[0] * parts[1]
    if kind == "logsumexp":
        return torch.logaddexp(*parts)
    raise AssertionError(f"no combination for {kind}: it must be refused, not reduced")


REDUCTIONS = [
    (aten.sum.dim_IntList, ([1, 3],), {}, "sum"),
    (aten.sum.dim_IntList, ([2], True), {}, "sum"),
    (aten.mean.dim, ([-1], True), {}, "mean"),
    (aten.amax.default, ([1],), {}, "max"),
    (aten.amin.default, ([0, 2], True), {}, "min"),
    (aten.linalg_vector_norm.default, (2, [3], True), {}, "2-norm"),
    (aten.linalg_vector_norm.default, (3.0, [1]), {}, "3-norm"),
    (aten.linalg_norm.default, (None, [1]), {}, "2-norm"),  # torch.linalg.norm(w, dim=1): DoRA's weight norm
    (aten.linalg_norm.default, (None, [1, 3], True), {}, "2-norm"),  # Frobenius over two dims
    (aten.linalg_norm.default, (3, [2]), {}, "3-norm"),
    (aten.logsumexp.default, ([2],), {}, "logsumexp"),
    (aten.prod.dim_int, (1,), {}, "product"),
    (aten.var.correction, ([3],), {"keepdim": True}, "variance"),
    (aten.max.dim, (2,), {}, "max"),
]


@pytest.mark.parametrize("target,args,kwargs,kind", REDUCTIONS, ids=lambda v: str(v))
def test_a_reduction_carries_other_dims_and_leaves_a_partial_of_its_kind(target, args, kwargs, kind):
    x = torch.rand(SHAPE, dtype=F64) + 0.5
    node = _node(target, [x], *args, **kwargs)
    assert rules.partial_kind(node) == kind
    dims, keep = rules.reduction(node)
    out_index = 0 if isinstance(node.meta["val"], tuple) else None
    for dim in range(x.dim()):
        out_dim = rules.reduced_dim(node, dim)
        if dim not in dims:
            assert out_dim is not None and _holds(target, x, dim, out_dim, args, kwargs, out_index), (dim, out_dim)
            continue
        assert out_dim is None
        whole = target(x, *args, **kwargs)
        parts = [target(h, *args, **kwargs) for h in _halves(x, dim)]
        if out_index is not None:
            whole, parts = whole[0], [p[0] for p in parts]
        if kind in ("mean", "variance"):  # a mean: the halves' sums over the whole count (rewritten to a sum)
            if kind == "mean":
                assert torch.allclose((parts[0] + parts[1]) / 2, whole)
            continue  # a variance does not combine from the halves' variances: refused by the planners
        assert torch.allclose(_combined(kind, parts, node), whole, rtol=1e-5), (dim, kind)


def test_a_matrix_norm_is_not_a_norm_of_its_elements():
    # torch.linalg.norm of an order over two dims is a matrix norm (ord 2: the largest singular value): the halves'
    # norms do not combine into it as a p-norm would, so the rule names it apart and no planner combines it
    x = torch.rand(SHAPE, dtype=F64) + 0.5
    node = _node(aten.linalg_norm.default, [x], 2, [1, 2])
    assert rules.partial_kind(node) == "matrix norm"
    parts = [aten.linalg_norm.default(h, 2, [1, 2]) for h in _halves(x, 1)]
    assert not torch.allclose(_combined("2-norm", parts, node), aten.linalg_norm.default(x, 2, [1, 2]))


def test_aligned_and_cut_dims():
    out = torch.randn(2, 4, 6, 8, dtype=F64)
    assert rules.aligned_dim(4, 3, torch.randn(8, dtype=F64)) == 0
    assert rules.aligned_dim(4, 1, torch.randn(4, 1, 1, dtype=F64)) == 0
    assert rules.aligned_dim(4, 2, torch.randn(4, 1, 1, dtype=F64)) is None  # size 1: broadcast along it
    assert rules.aligned_dim(4, 0, torch.randn(6, 8, dtype=F64)) is None  # absent: broadcast
    assert rules.aligned_dim(4, 2, torch.tensor(1.0)) is None
    for target, args, dim in [(aten.split.Tensor, (2, 1), 1), (aten.chunk.default, (2, -1), 3),
                              (aten.unbind.int, (2,), 2), (aten.slice.Tensor, (-2, 0, 3), 2),
                              (aten.select.int, (0, 1), 0), (aten.narrow.default, (3, 2, 4), 3)]:
        assert rules.cut_dim(_node(target, [out], *args)) == dim, target



CUTS = [(aten.split.Tensor, (2, 1)), (aten.chunk.default, (2, -1)), (aten.unbind.int, (2,)),
        (aten.slice.Tensor, (-2, 1, 5)), (aten.select.int, (0, 1)), (aten.narrow.default, (3, 2, 4)),
        (aten.select.int, (3, -1))]


@pytest.mark.parametrize("target,args", CUTS, ids=lambda v: str(v))
def test_a_cut_along_another_dim_keeps_the_shard_where_torch_puts_it(target, args):
    x = torch.randn(SHAPE, dtype=F64)
    node = _node(target, [x], *args)
    for dim in range(x.dim()):
        out_dim = rules.kept_dim(node, dim)
        if dim == rules.cut_dim(node):
            assert out_dim is None
            continue
        assert _holds_with(lambda t: target(t, *args), x, dim, out_dim), (target, dim, out_dim)


def test_a_join_and_an_expand_place_the_shard_where_torch_puts_it():
    x, y = torch.randn(SHAPE, dtype=F64), torch.randn(SHAPE, dtype=F64)
    for target, at in [(aten.cat.default, 1), (aten.cat.default, -1), (aten.stack.default, 0),
                       (aten.stack.default, 2), (aten.stack.default, -1)]:
        g = fx.Graph()
        a, b = g.placeholder("a"), g.placeholder("b")
        a.meta["val"], b.meta["val"] = x, y
        node = g.call_function(target, ([a, b], at))
        node.meta["val"] = target([x, y], at)
        for dim in range(x.dim()):
            out_dim = rules.joined_dim(node, dim)
            if target is aten.cat.default and dim == at % x.dim():
                assert out_dim is None
                continue
            whole = target([x, y], at)
            for r in range(2):
                local = target([_halves(x, dim)[r], _halves(y, dim)[r]], at)
                assert torch.equal(local, _halves(whole, out_dim)[r]), (target, at, dim)
    small = torch.randn(4, 1, 8, dtype=F64)
    for sizes, local in [([2, 4, 6, 8], lambda t: t.expand(2, t.shape[0], 6, t.shape[2])),  # the size arg made local
                         ([3, -1, 5, -1], lambda t: t.expand(3, -1, 5, -1))]:
        node = _node(aten.expand.default, [small], sizes)
        for dim in (0, 2):
            assert _holds_with(local, small, dim, rules.expanded_dim(node, dim)), (sizes, dim)


INDEXED = [  # (indices as (dim, index) pairs, None elsewhere)
    [(1, torch.tensor([3, 0, 2]))],
    [(0, torch.tensor([1, 0])), (1, torch.tensor([0, 3]))],
    [(2, torch.tensor([[0, 5], [1, 1]]))],
    [(0, torch.tensor([1])), (2, torch.tensor([4]))],  # not adjacent: the index dims go in front
    [(1, torch.tensor([2, 1])), (3, torch.tensor([[7, 0]]))],
    [(1, torch.tensor([True, False, True, True]))],
    [(1, torch.rand(4, 6) > 0.5)],  # a mask over two dims makes one
]


@pytest.mark.parametrize("pairs", INDEXED, ids=lambda v: str([d for d, _ in v]))
def test_an_index_of_other_dims_places_the_shard_where_torch_puts_it(pairs):
    x = torch.randn(SHAPE, dtype=F64)
    last = max(d for d, _ in pairs)
    indices = [None] * (last + 1)
    for d, index in pairs:
        indices[d] = index
    g = fx.Graph()
    source = g.placeholder("x")
    source.meta["val"] = x
    nodes = []
    for k, index in enumerate(indices):
        if index is None:
            nodes.append(None)
            continue
        i = g.placeholder(f"i{k}")
        i.meta["val"] = index
        nodes.append(i)
    node = g.call_function(aten.index.Tensor, (source, nodes))
    node.meta["val"] = aten.index.Tensor(x, indices)
    read = set()
    for d, index in pairs:
        read |= set(range(d, d + (index.dim() if index.dtype == torch.bool else 1)))
    for dim in range(x.dim()):
        out_dim = rules.indexed_dim(node, dim)
        if dim in read:
            assert out_dim is None
            continue
        assert _holds_with(lambda t: aten.index.Tensor(t, indices), x, dim, out_dim), (pairs, dim, out_dim)


def _factorizations(total: int, parts: int) -> list:
    """Every ordered way of writing ``total`` as a product of ``parts`` sizes (ones included)."""
    if parts == 1:
        return [[total]]
    return [[f] + rest for f in range(1, total + 1) if total % f == 0
            for rest in _factorizations(total // f, parts - 1)]


def _rank_elements(t, dim: int, groups: int, rank: int):
    """What ``rank`` of two holds of ``t`` sharded on ``dim`` in ``groups`` equal blocks, each cut into 2 pieces: its
    piece of every block, flattened in ``t``'s order."""
    shape = list(t.shape)
    blocks = t.reshape(shape[:dim] + [groups, 2, shape[dim] // (groups * 2)] + shape[dim + 1:])
    return blocks.select(dim + 1, rank).flatten()


@pytest.mark.parametrize("in_sizes,dim,groups", [
    ([2, 8, 12], 2, 1), ([2, 8, 12], 1, 1), ([2, 8, 12], 2, 2), ([2, 8, 12], 1, 2), ([1, 8, 4, 2], 1, 1),
    ([4, 6], 0, 2), ([2, 2, 8], 2, 1)])
def test_a_view_keeps_each_ranks_pieces_where_the_view_rule_says(in_sizes, dim, groups):
    """``rules.view_blocks`` against torch's view, for every view of the input into 1 to 4 dims: where it names an
    output dim and its blocks, each of two ranks' pieces of the input are, element for element, its pieces of that
    dim of the output; where it names none, no output dim holds them so (``whole=1``: heads may split). With
    ``whole`` a rank's piece (context parallelism's positions), the dim it names is the same and keeps each piece
    in it with the dims after it."""
    x = torch.arange(math.prod(in_sizes)).reshape(in_sizes)
    piece = in_sizes[dim] // (groups * 2)
    for n in range(1, 5):
        for out_sizes in _factorizations(x.numel(), n):
            y = x.reshape(out_sizes)
            holds = [(e, b) for e in range(n) for b in range(1, out_sizes[e] + 1) if out_sizes[e] % (2 * b) == 0
                     and all(torch.equal(_rank_elements(x, dim, groups, r), _rank_elements(y, e, b, r))
                             for r in range(2))]
            found = rules.view_blocks(in_sizes, out_sizes, dim, groups, 2)
            assert (found in holds) if found is not None else not holds, (in_sizes, out_sizes, found, holds)
            kept = rules.view_blocks(in_sizes, out_sizes, dim, groups, 2, whole=piece)
            if kept is not None:
                e, b = kept
                assert kept == found and out_sizes[e] // (2 * b) * math.prod(out_sizes[e + 1:]) % piece == 0


@pytest.mark.parametrize("equation, shapes", [
    ("...hd,hod->...ho", [(2, 3, 4, 5), (4, 6, 5)]),  # xLSTM's headwise projection: [b, s, heads, d] per head
    ("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 6)]),  # batch dims lined up from the right, broadcast
    ("b...d,bd->b...", [(2, 3, 4, 5), (2, 5)]),
])
def test_an_einsum_ellipsis_is_named_out_as_broadcasting_lines_it_up(equation, shapes):
    # einsum_labels named no ellipsis (xLSTM's "...hd,hod->...ho" was whole under tp and refused under cp): its dims
    # now get labels of their own; the labelled equation computes what torch computes for the ellipsis one
    g = fx.Graph()
    values = [torch.randn(*shape, dtype=F64) for shape in shapes]
    nodes = [g.placeholder(f"x{i}") for i in range(len(values))]
    for node, value in zip(nodes, values):
        node.meta["val"] = value
    node = g.call_function(aten.einsum.default, (equation, nodes))
    specs, output = rules.einsum_labels(node)
    assert "." not in "".join(specs) + output
    assert [len(spec) for spec in specs] == [v.dim() for v in values]
    assert torch.equal(torch.einsum(f"{','.join(specs)}->{output}", *values), torch.einsum(equation, *values))


def test_log_sigmoid_is_elementwise_on_every_dim():
    # F.logsigmoid (xLSTM's input and forget gates) is one op torch does not tag pointwise: cp refused it as one that
    # "mixes the positions of the sequence"
    assert rules.family(aten.log_sigmoid.default) == "elementwise"
    x = torch.randn(SHAPE, dtype=F64)
    for d in range(x.dim()):
        assert _holds_with(aten.log_sigmoid.default, x, d, d), d


def test_the_real_and_imaginary_parts_of_a_complex_tensor_are_elementwise():
    # gateloop's a_cumprod.real (a view torch does not tag pointwise): cp ran it on the whole sequence, as no rule
    # placed it
    z = torch.complex(torch.randn(SHAPE, dtype=F64), torch.randn(SHAPE, dtype=F64))
    for target in (aten.real.default, aten.imag.default):
        assert rules.family(target) == "elementwise", target
        for d in range(z.dim()):
            assert _holds_with(target, z, d, d), (target, d)


def test_numpy_style_names_of_pointwise_ops_are_elementwise():
    # torch.multiply, torch.divide, torch.subtract ... (einx's einx.multiply calls torch.multiply) are CompositeImplicit
    # aliases torch does not tag pointwise: each is the elementwise family, and a shard of any dim passes through it
    x, y = torch.randn(SHAPE, dtype=F64), torch.randn(SHAPE, dtype=F64)
    for target in (aten.multiply.Tensor, aten.divide.Tensor, aten.subtract.Tensor, aten.arctan2.default):
        assert rules.family(target) == "elementwise", target
        whole = target(x, y)
        for dim in range(x.dim()):
            for r, (xh, yh) in enumerate(zip(_halves(x, dim), _halves(y, dim))):
                assert torch.allclose(target(xh, yh), _halves(whole, dim)[r], rtol=1e-12, atol=1e-12), (target, dim)
    assert rules.family(aten.negative.default) == "elementwise"
