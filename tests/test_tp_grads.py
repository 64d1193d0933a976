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
    partial = _partial(manifest)
    assert {"layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight"} <= partial
    assert _ops(manifest, "layers.0.attn.q_norm.weight") == ["all_reduce (gradient, once per step)"]
    # stage 0: the temperature scales the whole residual stream too, whose gradient comes whole from stage 1 (and
    # is the same on every rank): it keeps its copy, summed per microbatch
    assert "layers.0.attn.temperature" not in partial and "layers.0.norm1.weight" not in partial
    assert _ops(manifest, "layers.0.attn.temperature") == ["all_reduce (backward)"]
    # the last stage: every gradient of its residual stream comes from the head's column-wise input (parts), so
    # the parts are carried up to where the stream enters (one all-reduce) and the two row-wise outputs it adds
    # (their all-reduce's backward needs whole gradients); every whole parameter of the layer holds parts
    assert {"layers.1.attn.temperature", "layers.1.norm1.weight", "layers.1.norm2.weight", "norm.weight"} <= partial
    last = manifest["tp"]["stages"][1]["collectives"]
    assert sorted(c["after"] for c in last if c["op"] == "all_reduce (backward)") == [
        "layers_0_out_from_stage0", "linear_11", "linear_9"], last


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
    """An injected fault: stage 0's temperature marked as holding parts, its copy dropped, though the whole residual
    stream it scales gives it a gradient that is the same on every rank (summing the ranks' counts that twice)."""
    def wrong(walk, pinned):
        holding, summed = original(walk, pinned)
        for node in [n for n in summed if n.op == "placeholder" and n.name.endswith("temperature")]:
            summed.pop(node)
            holding.add(node)
        return holding, summed

    original = tp_grads._solve
    monkeypatch.setattr(tp_grads, "_solve", wrong)
    with pytest.raises(ValueError, match=r"gradient of layers\.0\.attn\.temperature"):
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


def test_a_frozen_table_read_by_the_heads_takes_no_gradient_sum():
    """RoFormer's sinusoidal position table is a frozen ``nn.Embedding``: read whole beside the heads split over the
    ranks, its values carry no gradient, so no copy sums one (the plan summed two per layer, one each for the
    queries' and the keys' read of it, when every parameter was taken as trainable)."""
    manifest = _check(model_path("tp_frozen_table"))
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    backward = [c["after"] for stage in manifest["tp"]["stages"] for c in stage["collectives"]
                if c["op"].startswith("all_reduce (backward")]
    # the input gradients of each layer's attention and MLP and of the head, as Megatron's plan sums them
    assert backward == ["layer_norm", "layer_norm_1", "layer_norm_2", "layer_norm_3", "norm_out"], backward
    assert "positions.weight" not in _partial(manifest)


def test_a_bias_read_at_each_ranks_heads_has_its_gradient_parts_carried_to_the_layer_input():
    """ProphetNet's relative position bias: a whole linear of the hidden states (through a ``chunk``) viewed per head,
    picked by ``gather`` and read at each rank's heads (``tp_piece``). Its gradient's parts reach the attention's
    input, summed for q, k and v anyway: no all-gather of ``[b, heads, s, s]`` per layer (1.42x Megatron's bytes at
    the zoo's ProphetNet, 7.7x at its default size), and the linear's parameters are summed once per step."""
    manifest = check_model(model_path("tp_bias_from_states"), schedule="gpipe", num_microbatches=2,
                           layout=Layout(pp=1, tp=2), verify="on")
    tp = manifest["tp"]
    assert tp["verified"]["status"] == "verified", tp["verified"]
    stage = tp["stages"][0]
    assert stage["layers"]["layers.0"][0] == stage["layers"]["layers.0"][1], stage["layers"]  # Megatron's bytes
    ops = [(c["op"], c["after"]) for c in stage["collectives"]]
    assert not [op for op, _after in ops if op == "all_gather (backward)"], ops
    assert [after for op, after in ops if op == "all_reduce (backward)"] == [
        "layer_norm", "layer_norm_1", "layer_norm_2", "layer_norm_3", "norm_out"], ops
    assert {"layers.0.attn.rel.weight", "layers.0.attn.rel.bias"} <= _partial(manifest)


@pytest.mark.parametrize("groups", [1, 2])
def test_tp_piece_backward_places_each_ranks_piece_and_the_parts_sum_to_the_gathered_gradient(monkeypatch, groups):
    """The runtime's ``tp_piece`` as each of two ranks runs it (it communicates nothing): forward this rank's piece,
    as ``tp_scatter``; backward its gradient piece in its place and zeros elsewhere, the ranks' results summing to
    the joined gradient ``tp_scatter``'s all-gather gives every rank (``groups`` 2: a ``[batch * seq]`` dim of two
    samples, each split over the ranks)."""
    tp_runtime._register()
    x = torch.arange(2 * 8 * 3, dtype=torch.float64).reshape(2, 8, 3)
    grad = torch.randn(2, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    monkeypatch.setitem(tp_runtime._STATE, "size", 2)
    placed = []
    for rank in range(2):
        monkeypatch.setitem(tp_runtime._STATE, "rank", rank)
        leaf = x.clone().requires_grad_(True)
        piece = torch.ops.tracepp.tp_piece(leaf, 1, groups)
        assert torch.equal(piece, tp_runtime._local_piece(x, 1, groups))
        local_grad = tp_runtime._local_piece(grad, 1, groups)
        piece.backward(local_grad)
        outside = leaf.grad.clone()
        outside.view(2, groups, 8 // groups, 3).chunk(2, dim=2)[rank].zero_()
        assert not outside.any()  # zeros outside this rank's piece
        placed.append(leaf.grad)
    assert torch.equal(placed[0] + placed[1], grad)


def test_a_fresh_tensor_written_into_and_read_after_takes_a_whole_gradient():
    """A tensor made fresh, filled in place by values that carry a gradient and read after (DeepSeek-V4's compressor:
    slices of a ``new_full``, then its softmax) passes its gradient to what was written, which the pass does not
    follow: its gradient is whole (summed before it). One only read through the write's own result (Llama 4's
    ``full_like(logits).scatter_(1, idx, top)``) passes nothing on from itself."""
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            gate = x.new_full((2, 3, 4), float("-inf"))
            gate[:, 1:] = x[:, :-1] @ self.w
            logits = x @ self.w
            top, idx = logits.topk(2, dim=-1)
            scores = torch.full_like(logits, float("-inf")).scatter_(-1, idx, top)
            return gate.softmax(-1), scores.sigmoid()

    graph = torch.export.export(Net(), (torch.randn(2, 3, 4),)).graph
    made = {n.target: n for n in graph.nodes if n.op == "call_function"}
    assert tp_grads._written_then_read(made[torch.ops.aten.new_full.default])
    assert not tp_grads._written_then_read(made[torch.ops.aten.full_like.default])
