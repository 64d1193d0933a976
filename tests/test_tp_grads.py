"""Gradients of replicated parameters read by sharded ops, summed over tp once per step (``split/tp_grads.py``,
``runtime/tensor_parallel.StepSums``), as Megatron-Core sums its q/k layernorms' and sequence-parallel norms'.

Tier 1 and 2: which parameters the split marks (q/k norm weights over heads split among the ranks; under sequence
parallelism every norm weight and a reduce-scattered linear's bias; never a parameter a whole op also reads), the
copies dropped from the program and the bytes per microbatch that leaves (a transformers Qwen3 layer at Megatron's),
the verification summing the ranks' parts and catching a parameter marked wrongly, and the runtime's sum over
several ``step`` calls of one optimizer step. Tier 3 (``test_e2e_tp.py``): trained equal to eager."""
import os

import pytest
import torch

from tracepp.driver import check_model
from tracepp.runtime import tensor_parallel as tp_runtime
from tracepp.runtime.mesh import Layout
from tracepp.split import tp_grads
from util import REPO, model_path

pytestmark = pytest.mark.timeout(600)
MODEL = model_path("tp_step_summed")


def _check(path=MODEL, mode="on", pp=2, **layout):
    return check_model(path, schedule="1f1b" if pp > 1 else "looped-bfs", num_microbatches=4,
                       layout=Layout(pp=pp, tp=2, **layout), verify=mode)


def _partial(manifest) -> set:
    return {fqn for fqn, entry in manifest["tp"]["params"].items() if entry.get("grad") == "partial"}


def _ops(manifest, fqn_part: str) -> list:
    name = "p_" + fqn_part.replace(".", "_")
    return [c["op"] for stage in manifest["tp"]["stages"] for c in stage["collectives"] if c["after"] == name]


def test_qk_norm_weights_are_summed_once_per_step_and_a_weight_a_whole_op_reads_is_not():
    manifest = _check()
    record = manifest["tp"]["verified"]
    assert record["status"] == "verified" and "repairs" not in record, record
    norms = {f"layers.{k}.attn.{n}_norm.weight" for k in range(2) for n in "qk"}
    assert _partial(manifest) == norms
    assert _ops(manifest, "layers.0.attn.q_norm.weight") == ["all_reduce (gradient, once per step)"]
    # the temperature scales the whole residual too: its gradient there is every rank's, so it keeps its copy
    assert manifest["tp"]["params"]["layers.0.attn.temperature"] == {"dim": None, "role": "replicate"}
    assert _ops(manifest, "layers.0.attn.temperature") == ["all_reduce (backward)"]


def test_under_sequence_parallelism_every_norm_weight_and_a_scattered_bias_are_summed_once_per_step():
    manifest = _check(sequence_parallel=True)
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    layer = {"norm1.weight", "norm2.weight", "attn.q_norm.weight", "attn.k_norm.weight", "attn.temperature",
             "down.bias"}
    assert _partial(manifest) == {f"layers.{k}.{n}" for k in range(2) for n in layer} | {"norm.weight"}
    assert not any(op == "all_reduce (backward)" for stage in manifest["tp"]["stages"]
                   for op in (c["op"] for c in stage["collectives"]))


def test_a_transformers_qwen3_layer_moves_megatrons_bytes(monkeypatch):
    """Its q/k norms over each head: 1.008x Megatron's bytes per microbatch while their weights' gradients were
    all-reduced at every microbatch."""
    monkeypatch.setenv("HF_FAMILY", "qwen3")
    manifest = _check(os.path.join(REPO, "tests", "zoo", "hf_family.py"))
    assert manifest["tp"]["verified"]["status"] == "verified"
    layers = [figures for stage in manifest["tp"]["stages"] for figures in stage["layers"].values()]
    assert layers and all(ours == megatron for ours, megatron in layers), layers
    assert any(fqn.endswith("q_norm.weight") for fqn in _partial(manifest))


def test_a_parameter_marked_partial_that_a_whole_op_also_reads_is_caught(monkeypatch):
    """An injected fault: every group of parameter-made values with a copy is marked, the temperature too (its
    gradient from the whole residual is the same on every rank, so summing the ranks' counts it twice)."""
    def wrong(walk):
        return [(fqns, values, bool(values)) for fqns, values, _ok in original(walk)]

    original = tp_grads._groups
    monkeypatch.setattr(tp_grads, "_groups", wrong)
    with pytest.raises(ValueError, match=r"gradient of layers\.\d\.attn\.temperature"):
        _check(mode="strict")


class _Param:
    def __init__(self, grad):
        self.grad = grad


def test_step_sums_reduce_only_what_each_step_added(monkeypatch):
    """Two ranks holding equal parts (all_reduce doubles): one step's part summed once; a second ``step`` before
    the optimizer (accumulation) adds its part, and only that is summed."""
    monkeypatch.setattr(tp_runtime.dist, "all_reduce", lambda tensor, group=None: tensor.mul_(2))
    params = [_Param(None), _Param(None)]
    sums = tp_runtime.StepSums(params, group=None)
    sums.begin()
    params[0].grad, params[1].grad = torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])
    sums.end()
    assert params[0].grad.tolist() == [2.0, 4.0] and params[1].grad.tolist() == [[6.0]]
    sums.begin()
    params[0].grad += torch.tensor([0.5, 0.25])
    params[1].grad += 1.0
    sums.end()
    assert params[0].grad.tolist() == [3.0, 4.5] and params[1].grad.tolist() == [[8.0]]
    params[0].grad = params[1].grad = None  # zero_grad(set_to_none): the next step starts from nothing
    sums.begin()
    sums.end()
    assert params[0].grad is None
