"""split/derived_weights.py: a linear's weight computed from one parameter at every call, traced back to the
parameter's dim (tier 1: exported graphs, no planner)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tracepp.split import derived_weights as dw


def _graph(module, *inputs):
    return torch.export.export(module, inputs).graph


def _weight_of(graph, index=0):
    """The weight node of the ``index``-th linear (or conv1d) of ``graph``."""
    users = [n for n in graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.linear.default, torch.ops.aten.conv1d.default)]
    return users[index].args[1]


class _Normalized(nn.Module):
    """nGPT's NormLinear: ``F.normalize(W, dim)`` before each call."""

    def __init__(self, dim):
        super().__init__()
        self.weight, self.dim = nn.Parameter(torch.randn(8, 6)), dim

    def forward(self, x):
        return F.linear(x, F.normalize(self.weight, dim=self.dim))


def test_a_norm_over_the_other_dim_keeps_the_claimed_one():
    g = _graph(_Normalized(-1), torch.randn(2, 6))
    weight = _weight_of(g)
    placeholder = dw._chain(weight)
    assert placeholder is not None and placeholder.op == "placeholder"
    way = dw._rearranged(weight, 0, 2)  # rows (output features) normalised each on its own: claimed as dim 0
    assert way is not None and way[-1] == (placeholder, 0)
    assert dw.blocking_step(weight, 0, 2) is None
    step = dw.blocking_step(weight, 1, 2)  # the norm is over dim 1: a piece of it cannot be normalised alone
    assert step is not None and step.target is torch.ops.aten.linalg_vector_norm.default


def test_a_norm_over_the_claimed_dim_is_named():
    g = _graph(_Normalized(0), torch.randn(2, 6))
    weight = _weight_of(g)
    assert dw._rearranged(weight, 1, 2)[-1][1] == 1
    assert dw.blocking_step(weight, 0, 2).target is torch.ops.aten.linalg_vector_norm.default


class _Parts(nn.Module):
    """litgpt's LoRA: ``lora_B.unsqueeze(-1).split(sizes)[i]`` as a 1 x 1 convolution's weight."""

    def __init__(self):
        super().__init__()
        self.lora_B = nn.Parameter(torch.randn(16, 4))

    def forward(self, x):
        parts = self.lora_B.unsqueeze(-1).split((8, 4, 4))
        return torch.cat([F.conv1d(a, b) for a, b in zip(x.chunk(3, dim=1), parts)], dim=1)


def test_a_part_cut_by_split_is_a_segment_of_its_parameter():
    g = _graph(_Parts(), torch.randn(2, 12, 5))
    ends = [_weight_of(g, i) for i in range(3)]
    assert all(dw._chain(end) is not None for end in ends)
    way = dw._rearranged(ends[1], 0, 2)
    assert way is not None and way[-1][1] == 0  # the parameter's rows
    cut = dw.cut_segments(way, None, 2)
    assert list(cut.values()) == [(8, 4, 4)]
    assert dw.sizes_kept(way, cut)
    assert dw.cut_segments(way, None, 8) is False  # parts --tp does not divide
    assert dw.reads_as_weight(next(iter(ends[0].users)), ends[0])


def test_an_activation_is_not_a_derived_weight():
    class Product(nn.Module):
        def forward(self, x, y):
            return F.linear(x, y * 2)

    g = _graph(Product(), torch.randn(2, 6), torch.randn(8, 6))
    assert dw._chain(_weight_of(g)) is not None  # one placeholder: found, and the walk asks whether it is a parameter

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(8, 6))

        def forward(self, x):
            return F.linear(x, self.a * self.b)  # two parameters: no one parameter to claim

    assert dw._chain(_weight_of(_graph(Two(), torch.randn(2, 6)))) is None


class _TwoParameters(nn.Module):
    """KAN-GPT's spline weight, ``spline_weight * spline_scaler.unsqueeze(-1)`` viewed ``[out, in * 8]``; and AdaLoRA's
    ``(lora_A * lora_E).T``, ``lora_E`` ``[r, 1]`` broadcast along ``lora_A``'s input features."""

    def __init__(self):
        super().__init__()
        self.spline_weight, self.spline_scaler = nn.Parameter(torch.randn(4, 6, 8)), nn.Parameter(torch.randn(4, 6))
        self.lora_A, self.lora_E = nn.Parameter(torch.randn(3, 6)), nn.Parameter(torch.randn(3, 1))

    def forward(self, bases, x):
        spline = F.linear(bases, (self.spline_weight * self.spline_scaler.unsqueeze(-1)).view(4, -1))
        return spline, x @ (self.lora_A * self.lora_E).T


def test_a_weight_of_two_parameters_traces_each_parameters_dim():
    g = _graph(_TwoParameters(), torch.randn(2, 48), torch.randn(2, 6))
    weight = _weight_of(g)
    found = dw._chains(weight)
    assert found is not None and len(found) == 2 and dw._chain(weight) is None  # several: not one parameter's
    names = {p.name: p for p in found}
    for dim, wanted in ((0, {"spline_weight": 0, "spline_scaler": 0}), (1, {"spline_weight": 1, "spline_scaler": 1})):
        way = dict(dw._rearranged(weight, dim, 2))  # each output feature, each input feature's 8 bases kept apart
        assert {name.split("_", 1)[1]: way[p] for name, p in names.items()} == wanted
    product = next(n for n in g.nodes if n.target is torch.ops.aten.matmul.default).args[1]  # (lora_A * lora_E).T
    assert len(dw._chains(product)) == 2
    assert dw._rearranged(product, 0, 2) is None  # lora_A's input features: lora_E is broadcast along them


class _Ternary(nn.Module):
    """HF BitNet's ``WeightQuant`` as tracepp traces it (a straight-through estimator): the weight scaled by the mean
    of ``|w|`` over the whole weight, rounded to -1, 0, 1, ``w + (q - w).detach()``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 6))

    def forward(self, x):
        w = self.weight.float()
        scale = 1.0 / w.abs().mean().clamp_(min=1e-5)
        return F.linear(x, w + ((w * scale).round().clamp(-1, 1) / scale - w).detach())


def test_a_weight_scaled_by_a_reduction_of_all_of_it_is_traced_with_the_reduction_whole():
    g = _graph(_Ternary(), torch.randn(2, 6))
    weight = _weight_of(g)
    placeholder = dw._chain(weight)
    assert placeholder is not None and placeholder.op == "placeholder"
    for dim in (0, 1):  # either dim: each rank's piece reduced, the ranks' sums combined
        way = dw._rearranged(weight, dim, 2)
        assert way is not None and way[-1] == (placeholder, dim)
        whole = {node.target for node, at in way if at is None}
        assert torch.ops.aten.mean.default in whole and torch.ops.aten.reciprocal.default in whole, way
        assert all(at == dim for node, at in way if node.target is torch.ops.aten.abs.default)
