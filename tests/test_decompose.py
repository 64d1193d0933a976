"""split/decompose.py: a norm written out computes what the norm computes (tier 1: plain graphs, no planner)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tracepp.split import decompose


class _Norm(nn.Module):
    def __init__(self, kind: str, shape, affine: bool):
        super().__init__()
        self.kind, self.shape = kind, shape
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(shape)) if affine else None
        self.bias = nn.Parameter(0.1 * torch.randn(shape)) if affine and kind == "layer" else None

    def forward(self, x):
        if self.kind == "layer":
            return F.layer_norm(x, self.shape, self.weight, self.bias, eps=1e-6) * 2
        return F.rms_norm(x, self.shape, self.weight) * 2  # eps None: the dtype's machine epsilon


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(16,), (4, 16)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_norm_written_out_computes_the_norm(kind, affine, shape, dtype):
    torch.manual_seed(0)
    module = _Norm(kind, shape, affine).to(dtype)
    x = (3 + 2 * torch.randn(2, 5, *shape)).to(dtype)
    gm = torch.export.export(module, (x,)).module()
    norms = [n for n in gm.graph.nodes if n.target in decompose.NORMS]
    assert len(norms) == 1
    expected = gm(x)
    made = decompose.norms(gm.graph, {norms[0].name})[norms[0].name]
    gm.recompile()
    assert not [n for n in gm.graph.nodes if n.target in decompose.NORMS]
    assert all(isinstance(node.meta.get("val"), torch.Tensor) for node in made)  # each made with its fake value
    assert made[-1].meta["val"].shape == x.shape
    assert made[-1].meta["val"].dtype == dtype
    got = gm(x)
    tolerance = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 0.0}[dtype]  # bf16: computed in fp32
    assert got.dtype == dtype
    assert (got.double() - expected.double()).abs().max().item() <= tolerance


class _VectorNorm(nn.Module):
    def __init__(self, p, dim, keepdim: bool, dtype=None):
        super().__init__()
        self.p, self.dim, self.keepdim, self.dtype = p, dim, keepdim, dtype

    def forward(self, x):
        return torch.linalg.vector_norm(x, self.p, self.dim, self.keepdim, dtype=self.dtype) * 2


@pytest.mark.parametrize("p", [2, 1, 3, 2.5])
@pytest.mark.parametrize("dim, keepdim", [(-1, True), ((1, 2), False), (None, False)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_vector_norm_written_out_computes_the_norm_and_its_gradient(p, dim, keepdim, dtype):
    """F.normalize's norm: sum(|x|^p)^(1/p), a sum each rank takes of its piece; a row of zeros (padding) gets the
    gradient 0 as torch's does, not 0 / 0."""
    torch.manual_seed(0)
    module = _VectorNorm(p, dim, keepdim)
    x = torch.randn(2, 5, 16).to(dtype)
    x[0, 1] = 0  # a row of zeros
    gm = torch.export.export(module, (x,)).module()
    norm, = [n for n in gm.graph.nodes if n.target in decompose.NORMS]
    leaf = x.clone().requires_grad_()
    expected = gm(leaf)
    expected.sum().backward()
    expected_grad = leaf.grad
    made = decompose.norms(gm.graph, {norm.name})[norm.name]
    gm.recompile()
    assert not [n for n in gm.graph.nodes if n.target in decompose.NORMS]
    assert made[-1].meta["val"].shape == expected.shape and made[-1].meta["val"].dtype == dtype
    leaf = x.clone().requires_grad_()
    got = gm(leaf)
    got.sum().backward()
    assert got.dtype == dtype and leaf.grad.dtype == dtype
    tolerance = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    scale = expected.double().abs().max().item()
    assert (got.double() - expected.double()).abs().max().item() <= tolerance * scale
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad.double() - expected_grad.double()).abs().max().item() <= tolerance * 10
    if dim == -1:
        assert (leaf.grad[0, 1] == 0).all()  # the row of zeros: 0, as torch's


def test_a_vector_norm_of_an_infinite_order_is_not_written_out():
    gm = torch.export.export(_VectorNorm(float("inf"), -1, True), (torch.randn(2, 4),)).module()
    norm, = [n for n in gm.graph.nodes if n.target in decompose.NORMS]
    assert decompose.order(norm) is None
    with pytest.raises(ValueError, match="order inf is not a sum"):
        decompose.norm(gm.graph, norm)


class _Cell(nn.Module):
    def __init__(self, kind: str, bias: bool):
        super().__init__()
        self.cell = nn.GRUCell(8, 12, bias=bias) if kind == "gru" else nn.RNNCell(8, 12, bias=bias, nonlinearity=kind)

    def forward(self, x, h):
        return self.cell(x, h) * 2


@pytest.mark.parametrize("kind", ["gru", "tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_recurrent_cell_written_out_computes_the_cell_and_its_gradients(kind, bias):
    """x-transformers' GRU gate: ``aten.gru_cell`` (and the RNN cells) as its two linears and the gates, the value and
    every gradient as ATen's cell computes them."""
    torch.manual_seed(0)
    module = _Cell(kind, bias).double()
    x, h = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64)
    gm = torch.export.export(module, (x, h)).module()
    assert len([n for n in gm.graph.nodes if n.target in decompose.CELLS]) == 1
    reference = copy.deepcopy(gm)
    made = decompose.cells(gm.graph)
    gm.recompile()
    assert made and not [n for n in gm.graph.nodes if n.target in decompose.CELLS]
    assert all(node.meta.get("written_out") for node in made)  # plan_cost: no Megatron figure for such a layer
    assert made[-1].meta["val"].shape == (6, 12)
    results = []
    for program in (reference, gm):
        xs, hs = x.clone().requires_grad_(), h.clone().requires_grad_()
        out = program(xs, hs)
        out.pow(2).sum().backward()
        results.append([out, xs.grad, hs.grad] + [p.grad for p in program.parameters()])
        program.zero_grad()
    for want, got in zip(*results):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
