"""Tier 1/2 (one process, no timing asserted): the plain-autograd stage costs, the zero-bubble split's exactness
and its reused graph analysis, and the cheap non-finite witness."""
import json
import math

import pytest
import torch

from tracepp.costs.costs_file import load_costs
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.runtime import Pipeline
from tracepp.runtime.executor import WeightSplit, _finite_witness
from tracepp.costs.model import runtime_factors
from tracepp.costs.measure_stages import NOTHING, StageCallables, measure_runtime_costs, measure_stage_costs, measure_stage_times
from util import model_path


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("perf") / "out")
    split_model(model_path("tied_lm"), out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    return out


def test_stage_costs_cover_every_stage_and_kind(tied_folder, tmp_path):
    costs = measure_stage_costs(tied_folder, rounds=1, max_microbatches=2)
    assert set(costs) == {f"{stage}{kind}" for stage in (0, 1) for kind in "FBIW"}
    assert all(isinstance(value, float) and value > 0 for value in costs.values())
    assert costs["0I"] == NOTHING  # stage 0 receives no activation that needs a gradient: its W is its B
    for stage in (0, 1):  # the best split's halves add up to one full backward
        assert math.isclose(costs[f"{stage}I"] + costs[f"{stage}W"], costs[f"{stage}B"], rel_tol=1e-6, abs_tol=2 * NOTHING)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    assert load_costs(str(path), 2)[(1, "W")] == costs["1W"]  # the format `tracepp plan --costs` reads
    details = measure_stage_times(tied_folder, rounds=2, max_microbatches=1, clock="cpu")
    assert details["rounds"] == 2 and details["microbatches_timed"] == 1 and details["clock"] == "cpu"
    assert len(details["samples"]["1B"]) == 2 and set(details["W_autograd"]) == {"0", "1"}


def test_stage_cost_meter_times_only_the_stages_it_is_given(tied_folder):
    """A rank of a run times its own stages (benchmarks/tracepp_worker.py): only their keys, no W_autograd."""
    from tracepp.costs.measure_stages import StageCostMeter

    meter = StageCostMeter(tied_folder, max_microbatches=1, stages=[1], naive_weight=False)
    meter.run_round()
    result = meter.result()
    assert set(result["costs"]) == {"1F", "1B", "1I", "1W"} and result["W_autograd"] == {}
    assert {key[0] for key in result["samples"]} == {"1"}


def test_runtime_costs_time_the_same_kinds_through_the_executor(tied_folder):
    measured = measure_runtime_costs(tied_folder, rounds=1, max_microbatches=2)
    kinds = {f"{stage}{kind}" for stage in (0, 1) for kind in "FBIW"}
    assert set(measured["costs"]) == kinds
    # the W is timed both deferred past the other stages' I's and right after its own I
    assert set(measured["runtime_costs"]) == kinds | {"0W_after_I", "1W_after_I"}
    assert all(value > 0 for value in measured["runtime_costs"].values())
    factors = runtime_factors(measured["costs"], measured["runtime_costs"])
    assert set(factors) == {"F", "B", "I", "W", "W_after_I"} and all(value > 0 for value in factors.values())


def test_runtime_meter_times_w_deferred_and_right_after_its_i(tied_folder):
    from tracepp.costs.measure_stages import RuntimeCostMeter

    meter = RuntimeCostMeter(tied_folder, max_microbatches=2)
    assert meter.after_input == {3}  # microbatches 0, 2: F + B; 1: I's then W's; 3: each W after its I
    listed = [label for _instruction, _releases, label in meter.pipe.executor.program]
    assert listed[listed.index("1I1"):listed.index("1I1") + 4] == ["1I1", "0I1", "1W1", "0W1"]
    assert listed[listed.index("1I3"):listed.index("1I3") + 4] == ["1I3", "1W3", "0I3", "0W3"]
    meter.run_round()
    assert {kind for _stage, kind in meter.samples} == {"F", "B", "I", "W", "W_after_I"}
    assert len(meter.samples[(1, "W")]) == len(meter.samples[(1, "W_after_I")]) == 1
    ratios = meter.split_ratios()
    assert set(ratios) == {0, 1} and all(set(r) == {"W", "W_after_I"} and min(r.values()) > 0 for r in ratios.values())


def test_split_ratios_pair_each_b_with_the_next_microbatchs_i_and_w():
    # known answer: a slow spell in round 1 slows B, I and W alike; per-pair ratios cancel it, medians would not
    from tracepp.costs.measure_stages import RuntimeCostMeter

    meter = RuntimeCostMeter.__new__(RuntimeCostMeter)
    meter.pairs, meter.after_input = [(0, 1), (2, 3)], {3}
    meter.by_microbatch = {(0, "B", 0): [1.0, 2.0, 1.0], (0, "I", 1): [0.6, 1.2, 0.6], (0, "W", 1): [0.5, 1.0, 0.5],
                           (0, "B", 2): [1.0, 2.0], (0, "I", 3): [0.5, 1.0], (0, "W", 3): [0.5, 1.0]}
    assert meter.split_ratios() == {0: {"W": pytest.approx(1.1), "W_after_I": pytest.approx(1.0)}}


def test_cost_meters_set_the_heap_thresholds_the_ranks_run_with(tied_folder, monkeypatch):
    # Left at glibc's defaults, the executor's rounds took thousands of page faults each and the plain rounds none,
    # so the runtime factors followed the fault count; both meters now configure the heap as run.py does.
    from tracepp.runtime import host_memory
    from tracepp.costs.measure_stages import RuntimeCostMeter

    configured = []
    monkeypatch.setattr(host_memory, "configure", lambda device: configured.append(torch.device(device).type))
    StageCallables(tied_folder, max_microbatches=1)
    RuntimeCostMeter(tied_folder, max_microbatches=1)
    assert configured == ["cpu", "cpu"]


def test_the_plain_b_frees_its_graph_before_its_timing_ends():
    # tracepp's executor frees a microbatch's graph inside its B (or W) action; the plain B it is compared with
    # must pay the same, not leave it to the next untimed forward
    import weakref

    from tracepp.costs.measure_stages import StageCostMeter

    leaf = torch.randn(4, 4, requires_grad=True)
    out = (leaf * 2).relu()
    gone = weakref.ref(out)
    graph = [[leaf], [out], [torch.ones(4, 4)]]
    del out
    StageCostMeter._backward_and_free(graph)
    assert gone() is None and graph == [] and leaf.grad is not None


def _grads(callables, stage, mb, split=None):
    """Input and parameter gradients of one microbatch of ``stage``: one full backward, or I then W."""
    params = callables.params[stage]
    for param in params:
        param.grad = None
    received, tensors, grads = callables.forward(stage, mb)
    if split is None:
        torch.autograd.backward(tensors, grads)
        inputs = [value.grad for value in received]
    else:
        inputs, pending, keep = split.input_backward(tensors, grads, received)
        assert all(p.grad is None for p in params if p.dim() > 1), "I computed a matrix weight's gradient"
        WeightSplit.weight_backward(pending, tensors if keep else None, grads if keep else None)
    return inputs, [p.grad.clone() for p in params]


def test_split_backward_equals_full_backward_bit_for_bit(tied_folder):
    callables = StageCallables(tied_folder, max_microbatches=2)
    calls = []

    class CountingSplit(WeightSplit):
        def _plan(self, *args):
            calls.append(args)
            return super()._plan(*args)

    split = CountingSplit(callables.params[1])
    for mb in range(2):
        expected_inputs, expected_params = _grads(callables, 1, mb)
        inputs, params = _grads(callables, 1, mb, split)
        assert all(torch.equal(a, b) for a, b in zip(inputs, expected_inputs))
        assert len(params) == len(expected_params) > 0
        assert all(torch.equal(a, b) for a, b in zip(params, expected_params))
    assert len(calls) == 1, "the second microbatch's graph has the same shape: its analysis is reused"


def test_split_backward_analyses_a_graph_of_another_shape_afresh():
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    params = [lin.weight, lin.bias, norm.weight, norm.bias]
    calls = []

    class CountingSplit(WeightSplit):
        def _plan(self, *args):
            calls.append(args)
            return super()._plan(*args)

    split = CountingSplit(params)

    def graphs(x, deep):
        h = lin(norm(x))
        return lin(torch.tanh(h)) if deep else h

    for deep in (False, True, False):
        x = torch.randn(3, 4, requires_grad=True)
        grad_out = torch.randn(3, 4)
        graphs(x, deep).backward(grad_out)
        expected = [x.grad.clone()] + [p.grad.clone() for p in params]
        x.grad = None
        for p in params:
            p.grad = None
        out = graphs(x, deep)
        (dx,), pending, keep = split.input_backward([out], [grad_out], [x])
        assert keep is deep  # lin used twice: its weights take a backward from the outputs
        WeightSplit.weight_backward(pending, [out] if keep else None, [grad_out] if keep else None)
        got = [dx] + [p.grad for p in params]
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for p in params:
            p.grad = None
    assert len(calls) == 3  # each change of shape is analysed afresh


def test_finite_witness_is_finite_exactly_when_every_element_is():
    big = torch.full((1000,), 3e38)  # finite fp32 values whose fp32 sum would overflow
    cases = [(torch.zeros(0), True), (torch.randn(2, 3), True), (big, True), (-big, True),
             (torch.full((4,), 6e4, dtype=torch.float16), True), (torch.full((8,), 3e38, dtype=torch.bfloat16), True),
             (torch.full((3,), 1e308, dtype=torch.float64), True)]
    for bad in (float("inf"), -float("inf"), float("nan")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            tensor = torch.ones(5, 7, dtype=dtype)
            tensor[3, 2] = bad
            cases.append((tensor, False))
    both = torch.zeros(4)
    both[0], both[1] = float("inf"), -float("inf")
    cases.append((both, False))
    for tensor, finite in cases:
        witness = _finite_witness(tensor.requires_grad_(tensor.numel() > 0))
        assert witness.dim() == 0 and bool(torch.isfinite(witness)) is finite, (tensor, witness)


def test_nonfinite_report_names_the_first_stage_and_microbatch(tmp_path):
    path = model_path("nan_token")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    pipe = Pipeline(out, all_stages=True)
    args, kwargs, target = pipe.user.batch(0)
    loss = pipe.step(args, kwargs, target)
    assert bool(torch.isfinite(loss)) and pipe.executor.nonfinite_outputs() == []
    args, kwargs, target = pipe.user.batch(1)  # sample 5 holds the NaN embedding row: microbatch 2
    loss = pipe.step(args, kwargs, target)
    assert pipe.executor.nonfinite_outputs()[0] == (0, 2)
    assert "the output of stage 0 (rank 0; modules embed, layers.0, layers.1) went non-finite first, at " \
           "microbatch 2" in pipe.nonfinite_report(float(loss))
