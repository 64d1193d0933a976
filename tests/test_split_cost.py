"""Tier 1: the split step's cost model and its choice of cuts, on plain data (no tracing)."""
import pytest
import torch

from tracepp.split import cost
from tracepp.split.cost import SegmentCost
from tracepp.split.partition import repeated_blocks, segment_key, segment_starts


def test_inflight_microbatches_follows_the_schedule():
    assert [cost.inflight_microbatches("1f1b", stage, 4, 8) for stage in range(4)] == [4, 3, 2, 1]
    assert [cost.inflight_microbatches("1f1b", stage, 4, 2) for stage in range(4)] == [2, 2, 2, 1]
    assert [cost.inflight_microbatches("gpipe", stage, 4, 8) for stage in range(4)] == [8, 8, 8, 8]
    assert cost.inflight_microbatches("1f1b", 0, 4, 8, training=False) == 1


def test_stage_estimate_counts_params_grads_adam_and_inflight_activations():
    segment = SegmentCost(forward_flops=1000, num_params=10, param_bytes=40, activation_bytes=100)
    estimate = cost.stage_estimate(segment, inflight=3)
    assert estimate["grad_bytes"] == 40 and estimate["optimizer_bytes"] == 80  # two fp32 states per parameter
    assert estimate["activation_bytes"] == 300 and estimate["memory_bytes"] == 40 + 40 + 80 + 300
    assert estimate["step_flops_per_microbatch"] == 3000  # forward + backward (2x)
    forward_only = cost.stage_estimate(segment, inflight=1, training=False)
    assert forward_only["memory_bytes"] == 140 and forward_only["step_flops_per_microbatch"] == 1000


def test_imbalance_is_max_over_mean():
    assert cost.imbalance([1, 2, 3]) == pytest.approx(1.5)
    assert cost.imbalance([0, 0]) is None


def _flops_only(stage_index, stage_cost):
    return 0


def test_cuts_balance_flops():
    equal = [SegmentCost(forward_flops=1) for _ in range(8)]
    assert cost.choose_cuts(equal, 2, _flops_only) == [4]
    assert cost.choose_cuts(equal, 4, _flops_only) == [2, 4, 6]
    # a heavy first segment gets a stage of its own
    assert cost.choose_cuts([SegmentCost(forward_flops=f) for f in (4, 1, 1, 1, 1)], 2, _flops_only) == [1]
    # every stage gets at least one segment, even when the FLOPs would rather merge them
    assert cost.choose_cuts([SegmentCost(forward_flops=f) for f in (0, 0, 9)], 3, _flops_only) == [1, 2]


def test_equal_flops_are_broken_by_memory_under_the_schedule():
    """Two cuts give the same FLOPs; the parameter-heavy middle segment (an embedding: no counted FLOPs) goes to
    the stage that keeps fewer microbatches' activations in flight."""
    segments = [SegmentCost(forward_flops=2, activation_bytes=5), SegmentCost(param_bytes=10),
                SegmentCost(forward_flops=2, activation_bytes=5)]

    def memory_of(stage_index, stage_cost):  # stage 0 keeps two microbatches in flight, stage 1 one
        return stage_cost.param_bytes + stage_cost.activation_bytes * (2 - stage_index)

    # cut at 1: memories 10 and 15; cut at 2: 20 and 5
    assert cost.choose_cuts(segments, 2, memory_of) == [1]


def _cuts_searched_in_full(segments, num_stages, memory_of):
    """The reference: the same dynamic programme over every (stage, first segment), nothing skipped."""
    count = len(segments)
    spans = {(a, b): sum(segments[a:b], SegmentCost()) for a in range(count) for b in range(a + 1, count + 1)}
    worst = (float("inf"), float("inf"))
    best = [[worst] * (count + 1) for _ in range(num_stages)]
    cut_at = [[0] * (count + 1) for _ in range(num_stages)]
    for end in range(1, count + 1):
        best[0][end] = (spans[0, end].forward_flops, memory_of(0, spans[0, end]))
    for k in range(1, num_stages):
        for end in range(k + 1, count + 1):
            for start in range(k, end):
                before = best[k - 1][start]
                if before != worst:
                    here = spans[start, end]
                    found = (max(before[0], here.forward_flops), max(before[1], memory_of(k, here)))
                    if found < best[k][end]:
                        best[k][end], cut_at[k][end] = found, start
    cuts, end = [], count
    for k in range(num_stages - 1, 0, -1):
        end = cut_at[k][end]
        cuts.append(end)
    return sorted(cuts)


def test_cuts_skip_no_better_partition():
    """The search stops where a stage's FLOPs alone pass the best found (issue 56: a 405B tune's 128 segments x
    64 stages). On small random models (ties and zero-FLOP segments among them) its cuts are those of the search
    that skips nothing, and their largest stage FLOPs the least any partition has (memory breaks ties stage by
    stage, as it did: not always the least largest memory over every partition, 9 of these 300)."""
    import itertools
    import random

    rng = random.Random(0)
    for _trial in range(300):
        n = rng.randint(1, 9)
        segments = [SegmentCost(forward_flops=rng.choice([0, 10, 10, 20, rng.randint(0, 30)]),
                                param_bytes=rng.randint(0, 50), activation_bytes=rng.randint(0, 50)) for _ in range(n)]
        k = rng.randint(1, n)

        def memory_of(stage_index, stage_cost):
            return stage_cost.param_bytes + stage_cost.activation_bytes * (k - stage_index)

        def most_flops(cuts):
            bounds = [0, *cuts, n]
            return max(sum(s.forward_flops for s in segments[bounds[i]:bounds[i + 1]]) for i in range(k))

        cuts = cost.choose_cuts(segments, k, memory_of)
        assert cuts == _cuts_searched_in_full(segments, k, memory_of)
        assert most_flops(cuts) == min(most_flops(list(c)) for c in itertools.combinations(range(1, n), k - 1))


def test_more_stages_than_segments_is_refused():
    with pytest.raises(ValueError, match="cannot cut 2 segments into 3 stages"):
        cost.choose_cuts([SegmentCost(), SegmentCost()], 3, _flops_only)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList([_Block() for _ in range(3)])
        self.head = torch.nn.Linear(2, 4)


def test_repeated_blocks_are_the_children_of_integer_named_containers():
    blocks = repeated_blocks(_Model())
    assert {"encoder.layer.0", "encoder.layer.1", "encoder.layer.2"} <= blocks
    assert "encoder.layer.0.mlp.0" in blocks  # a Sequential's children too, but the outermost block wins:
    assert segment_key(["", "encoder", "encoder.layer.1", "encoder.layer.1.mlp", "encoder.layer.1.mlp.0"],
                       blocks) == "encoder.layer.1"
    assert segment_key(["", "head"], blocks) == "head"  # not in a block: the top-level child
    assert segment_key([""], blocks) == ""


def test_segment_starts_are_where_the_key_changes():
    keys = ["embed", "encoder.layer.0", "encoder.layer.0", "encoder.layer.1", "head", "head"]
    assert segment_starts(keys) == [1, 3, 4]


def test_gradient_flags_follow_autograd():
    """Which traced values carry a gradient (what crosses a stage boundary with one, what tp and cp price a
    gradient for), against eager autograd on the same expressions: ``type_as`` takes only its first operand's
    gradient, a tensor made like another and an integer or bool result take none."""
    import torch.nn as nn

    from tracepp.split import partition

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.register_buffer("table", torch.randn(4))

        def forward(self, x):
            h = x * self.w
            return h + self.table.type_as(h) + torch.zeros_like(h) + h.new_ones(4), h > 0, h.argmax(-1)

    net, x = Net(), torch.randn(2, 4)
    program = torch.export.export(net, (x,))
    trainable = {spec.arg.name for spec in program.graph_signature.input_specs if spec.target == "w"}
    flags = partition._gradient_flags(program.graph, trainable)
    got = {node.target: flags[node] for node in program.graph.nodes if node.op == "call_function"}
    aten = torch.ops.aten
    h = x * net.w
    expected = {aten.mul.Tensor: h.requires_grad, aten.type_as.default: net.table.type_as(h).requires_grad,
                aten.zeros_like.default: torch.zeros_like(h).requires_grad,
                aten.new_ones.default: h.new_ones(4).requires_grad, aten.gt.Scalar: (h > 0).requires_grad,
                aten.argmax.default: h.argmax(-1).requires_grad}
    assert {t: got[t] for t in expected} == expected
    assert expected[aten.mul.Tensor] and not any(v for t, v in expected.items() if t is not aten.mul.Tensor)


def test_gradient_flags_follow_an_in_place_write_of_a_value_that_carries_one():
    """A tensor made without a gradient (``new_full``) into whose slice a value that carries one is written carries
    one from there on, and so do its views and what reads them after (DeepSeek-V4's compressor: ``new_gate[:, 1:,
    :ratio] = chunk_gate[...]`` then ``new_gate.softmax(dim=2)``). Flagged without, the tp plan carried partial
    gradients through it unsummed (7e-3 from eager with --verify off; verification refused the split). What reads
    it before the write takes none, as autograd has it."""
    import torch.nn as nn

    from tracepp.split import partition

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            gate = self.w.new_full((2, 3, 4), float("-inf"))
            before = gate.exp()
            view = gate[:, 1:]
            view.copy_(x[:, :-1] @ self.w)
            return gate.softmax(-1), view * 2, before

    net, x = Net(), torch.randn(2, 3, 4)
    program = torch.export.export(net, (x,))
    trainable = {spec.arg.name for spec in program.graph_signature.input_specs if spec.target == "w"}
    flags = partition._gradient_flags(program.graph, trainable)
    got = {node.target: flags[node] for node in program.graph.nodes if node.op == "call_function"}
    aten = torch.ops.aten
    soft, doubled, before = net(x)
    assert got[aten.softmax.int] is soft.requires_grad is True
    assert got[aten.mul.Tensor] is doubled.requires_grad is True
    assert got[aten.exp.default] is before.requires_grad is False
    assert got[aten.new_full.default] is True  # the tensor written into: what reads it after takes a gradient
