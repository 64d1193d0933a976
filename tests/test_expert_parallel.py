"""Expert parallelism, tiers 1-2: the routed experts found in the traced graph, the plan as plain data, the
errors that name the values that would work, and the all-to-all ops' bookkeeping in one process."""
import os
import re

import pytest
import torch
import torch.nn.functional as F

from tracepp.driver import check_model
from tracepp.runtime.mesh import Layout
from util import model_path

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def _manifest(name: str, **layout):
    return check_model(os.path.join(ZOO, name + ".py"), num_microbatches=2, layout=Layout(pp=2, **layout))


def test_deepseek_v3_plan_shards_routed_experts_and_leaves_dense_and_shared_ones():
    # 3 layers: the first dense, then 8 routed experts (top 2) with a shared expert; global batch 4 x 8 tokens,
    # dp 2 x 2 microbatches: 8 tokens per microbatch, 16 (token, expert) pairs per block
    manifest = _manifest("deepseek_v3", dp=2, ep=2)
    ep = manifest["ep"]
    assert ep["size"] == 2 and manifest["plan"]["mesh"]["ep"] == 2
    assert sorted(ep["params"]) == [f"model.layers.{i}.mlp.experts.{w}" for i in (1, 2)
                                    for w in ("down_proj", "gate_up_proj")]
    assert ep["params"]["model.layers.1.mlp.experts.gate_up_proj"] == {
        "dim": 0, "experts": 8, "shape": [8, 32, 32], "local": [4, 32, 32]}
    assert [(b["name"], b["stage"], b["experts"], b["local_experts"], b["pairs"]) for b in ep["blocks"]] == [
        ("model.layers.1.mlp.experts", 0, 8, 4, 16), ("model.layers.2.mlp.experts", 1, 8, 4, 16)]
    # rows out (hidden 32, fp32) and back (32), half of them to the other rank, forward and backward
    assert ep["blocks"][0]["all_to_all_bytes"] == {"forward": 16 * (128 + 128) // 2, "backward": 2048}
    assert not any("shared_experts" in fqn or "layers.0" in fqn for fqn in ep["params"])


@pytest.mark.parametrize("name,experts", [("mixtral", 4), ("qwen3_moe", 8)])
def test_every_moe_family_is_found(name, experts):
    manifest = _manifest(name, dp=2, ep=2)
    blocks = manifest["ep"]["blocks"]
    assert len(blocks) == 2 and {b["experts"] for b in blocks} == {experts}
    assert all(entry["local"][0] == experts // 2 for entry in manifest["ep"]["params"].values())


def test_without_ep_the_blocks_only_count_tokens(tmp_path):
    from tracepp.driver import split_model

    out = str(tmp_path / "out")
    manifest = split_model(os.path.join(ZOO, "mixtral.py"), out, num_microbatches=2, layout=Layout(pp=2))
    assert manifest["ep"]["size"] == 1 and manifest["ep"]["params"] == {} and len(manifest["ep"]["blocks"]) == 2
    script = open(os.path.join(out, "rank0.py")).read()
    assert "tracepp.moe_tokens.default" in script and "ep_dispatch" not in script
    # the traced fallback loop runs as eager transformers chooses (tracepp.grouped_mm), not as the trace fell back
    assert "torch.ops.tracepp.grouped_mm.default(" in script
    assert "torch.ops.transformers.grouped_mm_fallback.default(" not in script


def test_grouped_mm_runs_the_kernel_eager_transformers_runs_and_equals_the_loop():
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracepp.runtime import expert_parallel

    torch.manual_seed(0)
    for last in (10, 8):  # every row routed; two rows past the last offset (no expert took them)
        rows, weight = torch.randn(10, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
        offsets = torch.tensor([3, 7, last], dtype=torch.int32)
        ours = torch.ops.tracepp.grouped_mm.default(rows, weight, offsets)
        loop = torch.ops.transformers.grouped_mm_fallback(rows, weight, offsets)
        plain = expert_parallel._loop_grouped_mm(rows, weight, offsets)
        assert torch.equal(ours, loop) and torch.equal(plain, loop) and not ours[last:].any()
        grad = torch.randn_like(ours)
        for a, b in zip(torch.autograd.grad(ours, (rows, weight), grad), torch.autograd.grad(loop, (rows, weight), grad)):
            assert torch.equal(a, b)  # rows no expert took get no gradient (the kernel leaves them unwritten)
    assert expert_parallel.native_grouped_mm(rows, weight)  # CPU: the kernel, as eager transformers
    assert not expert_parallel.native_grouped_mm(rows.half(), weight.half().to("meta"))
    with FakeTensorMode():  # torch's shape function for the kernel takes bf16 only: fake tensors take the loop
        assert torch.ops.tracepp.grouped_mm.default(torch.empty(10, 8), torch.empty(3, 8, 4),
                                                    torch.empty(3, dtype=torch.int32)).shape == (10, 4)


def test_errors_name_the_values_that_would_work():
    with pytest.raises(ValueError, match=r"--ep 2: this model has no routed experts .*split without --ep"):
        check_model(model_path("tied_lm_dp"), num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
    # experts called one by one (litgpt's LLaMAMoE): named, with the first one's line, and how to make them a block
    with pytest.raises(ValueError, match=r"its experts transformer\.h\.0\.mlp\.experts\.\* \(4 of them, the first at "
                                         r"lib_style\.py:\d+\) are called one by one.*grouped matmuls"):
        check_model(model_path("tp_expert_loop"), num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
    with pytest.raises(ValueError, match=r"--ep 4 takes each stage's expert-parallel ranks from its --dp 2 "
                                         r"data-parallel ranks, so it must divide --dp: use --ep in \[1, 2\]"):
        _manifest("mixtral", dp=2, ep=4)
    with pytest.raises(ValueError, match="use --dp-mode fsdp or ddp with --ep"):
        _manifest("mixtral", dp=4, ep=2, dp_mode="hsdp", dp_shard=2)


def test_an_expert_count_ep_does_not_divide_is_refused():
    # 4 experts over --ep 3 (with --dp 3, which a 3-sample batch would allow): the plan names the working sizes
    from tracepp.split import expert_parallel, tensor_parallel
    from util import trace_and_split

    _model_file, _traced, graph = trace_and_split(os.path.join(ZOO, "mixtral.py"))
    with pytest.raises(ValueError, match=r"--ep 3 does not divide the 4 routed experts of model\.layers\.0\.mlp\."
                                         r"experts: use --ep in \[1\] \(dividing both the experts and --dp 3\)"):
        expert_parallel.plan(graph, 3, 3, tensor_parallel.fqn_map)


def test_dispatch_and_combine_are_inverse_and_count_tokens_in_one_process():
    from tracepp.runtime import expert_parallel

    expert_parallel.set_group(None, 1, 0)
    expert_parallel.take_stats()
    rows = torch.randn(6, 3, requires_grad=True)
    offsets = torch.tensor([2, 2, 5, 5], dtype=torch.int32)  # 5 pairs routed, the sixth to no expert (dropped)
    local, local_offsets, plan = torch.ops.tracepp.ep_dispatch(rows, offsets, 4, "block")
    assert local.shape == (5, 3) and local_offsets.tolist() == [2, 2, 5, 5]
    out = torch.ops.tracepp.ep_combine(local * 3, plan, 6)
    assert torch.equal(out[:5], rows[:5] * 3) and torch.equal(out[5], torch.zeros(3))
    out.sum().backward()
    assert rows.grad[:5].eq(3).all() and rows.grad[5].eq(0).all()
    counts, dropped = expert_parallel.take_stats()["block"]
    assert counts.tolist() == [2, 0, 3, 0] and dropped == 1


def test_rows_received_from_each_source_are_regrouped_by_expert():
    from tracepp.runtime.expert_parallel import _order

    # source 0 sent 0 rows for local expert 0 and 2 for expert 1; source 1 sent 3 and 1
    assert _order(torch.tensor([[0, 2], [3, 1]])).tolist() == [2, 3, 4, 0, 1, 5]
    assert _order(torch.tensor([[1, 1], [1, 1]])).tolist() == [0, 2, 1, 3]


def test_a_safetensors_reader_reads_only_the_rows_asked_for(tmp_path):
    from safetensors.torch import save_file

    from tracepp.runtime.weights import open_checkpoint

    experts = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
    save_file({"w": experts, "b": torch.ones(5)}, str(tmp_path / "m.safetensors"))
    reader = open_checkpoint(str(tmp_path / "m.safetensors"))
    read = reader.read({"w": "w", "b": "b"}, {"w": (2, 4)})
    assert torch.equal(read["w"], experts[2:4]) and torch.equal(read["b"], torch.ones(5))


def test_check_prints_each_ranks_memory_and_every_parameters_placement(capsys):
    # the estimate per rank: the routed experts at 1/ep (outside FSDP), the rest FSDP's 1/dp
    from tracepp.cli import main

    assert main(["check", os.path.join(ZOO, "deepseek_v3.py"), "--dp", "2", "--ep", "2", "--microbatches", "2"]) == 0
    text = capsys.readouterr().out
    assert "bytes per rank between steps: tensor-parallel pieces, this rank's routed experts (1/ep)" in text
    assert "routed experts (ep=2): 4 expert weights sharded" in text
    assert "model.layers.*.mlp.experts.gate_up_proj  (x2)             one copy         Shard(0)  -     [4, 32, 32]" \
        in text
    manifest = _manifest("deepseek_v3", dp=2, ep=2)
    placements = manifest["placements"]
    assert placements["model.layers.1.mlp.experts.down_proj"] == {"dp": "one copy", "ep": 0, "tp": None,
                                                                  "per_rank": [4, 32, 16]}
    assert placements["lm_head.weight"] == {"dp": "shard(0) over 2", "ep": None, "tp": None, "per_rank": [32, 32]}
    # stage 1 (layer 2 with 8 experts, the norm and head): experts halved by ep, everything else by FSDP
    fp32 = 4
    state = {ref["fqn"]: ref["shape"] for ref in manifest["stages"][1]["state"] if ref["kind"] == "parameter"}
    experts = sum(torch.Size(s).numel() for f, s in state.items() if ".experts." in f)
    others = sum(torch.Size(s).numel() for f, s in state.items() if ".experts." not in f)
    buffers = sum(torch.Size(ref["shape"]).numel() for ref in manifest["stages"][1]["state"]
                  if ref["kind"] == "buffer")  # whole on every rank (the router's score bias, rotary's inv_freq)
    assert buffers and manifest["stages"][1]["estimate"]["grad_bytes"] == fp32 * (experts // 2 + others // 2)
    assert manifest["stages"][1]["estimate"]["param_bytes"] == fp32 * (experts // 2 + others // 2 + buffers)


def test_every_copy_of_the_runtime_shares_the_ops_state(tmp_path):
    # a rank process can import the folder's tracepp_runtime and, where tracepp is installed, tracepp.runtime;
    # the custom ops are registered by whichever comes first, and must read the groups and token counts the
    # runtime sets through the other (before: the tp group or the expert counts could land in the wrong copy)
    import importlib.util
    import sys

    from tracepp.driver import split_model
    from tracepp.runtime import expert_parallel, tensor_parallel

    out = str(tmp_path / "out")
    split_model(model_path("residual_mlp_lm"), out, layout=Layout(pp=2))
    package = os.path.join(out, "tracepp_runtime")
    spec = importlib.util.spec_from_file_location("tracepp_runtime_copy", os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tracepp_runtime_copy"] = module
    try:
        spec.loader.exec_module(module)
        copy_tp = importlib.import_module("tracepp_runtime_copy.tensor_parallel")
        copy_ep = importlib.import_module("tracepp_runtime_copy.expert_parallel")
        assert copy_tp._STATE is tensor_parallel._STATE and copy_tp._GATHERED is tensor_parallel._GATHERED
        assert copy_ep._STATE is expert_parallel._STATE and copy_ep._STATS is expert_parallel._STATS
    finally:
        for name in [n for n in sys.modules if n.startswith("tracepp_runtime_copy")]:
            del sys.modules[name]


def test_a_pointwise_op_between_the_expert_matmuls_moves_with_the_rows(monkeypatch):
    # Nemotron-H's experts square their ReLU (aten.square) between the matmuls: torch tags the op pointwise, so each
    # row is computed on its own and the op runs on the expert's rank (it used to be refused by name)
    import sys

    sys.path.insert(0, ZOO)
    monkeypatch.setenv("HF_FAMILY", "nemotron_h")
    manifest = check_model(os.path.join(ZOO, "hf_family.py"), num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
    blocks = manifest["ep"]["blocks"]
    assert blocks and not any(block.get("refused") for block in blocks), blocks
    assert all(entry["local"][0] == entry["experts"] // 2 for entry in manifest["ep"]["params"].values())


class _Experts(torch.nn.Module):
    """Routed experts as torchtitan computes them (``torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2,
    -1))``, gate and up each casting the rows), with the expert dim of ``w1`` and ``w2`` stored elsewhere; ``how``
    adds what expert parallelism must refuse."""

    def __init__(self, how: str = ""):
        super().__init__()
        self.how = how
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, 4))  # [in, out, experts]: permute(2, 0, 1)
        self.w2 = torch.nn.Parameter(torch.randn(16, 4, 32))  # [out, experts, in]: permute(1, 2, 0)
        self.w3 = torch.nn.Parameter(torch.randn(4, 32, 16))  # [experts, out, in]: torchtitan's

    def forward(self, rows, offsets):
        w1 = self.w1.reshape(16, 32, 4) if self.how == "reshape" else self.w1
        gate = torch._grouped_mm(rows.bfloat16(), w1.bfloat16().permute(2, 0, 1).contiguous(), offs=offsets)
        cast = rows.bfloat16()
        up = torch._grouped_mm(cast, self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        hidden = F.silu(gate) * up
        if self.how == "row norm":  # per row: a reduction over the features carries the rows
            hidden = hidden * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6).bfloat16()
        if self.how in ("rows summed", "rows flipped", "rows viewed"):
            hidden = hidden.float()
            hidden = {"rows summed": hidden - hidden.mean(0, keepdim=True), "rows flipped": hidden.flip(0),
                      "rows viewed": hidden.view(6, 2, 32).reshape(12, 32)}[self.how].bfloat16()
        out = torch._grouped_mm(hidden, self.w2.permute(1, 2, 0).bfloat16(), offs=offsets).float()
        if self.how == "weight read":
            out = out + self.w3.sum()
        if self.how == "rows read":
            out = out + cast.float().sum(-1, keepdim=True)
        return out


def _blocks(how: str = ""):
    from tracepp.split import expert_parallel

    program = torch.export.export(_Experts(how), (torch.randn(12, 16), torch.tensor([3, 6, 9, 12], dtype=torch.int32)))
    fqn_of = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.target}
    return expert_parallel.find_blocks(program.graph, fqn_of)


def test_expert_weights_through_casts_transposes_and_permutes_shard_on_their_expert_dim():
    # torchtitan's weights are [experts, out, in] multiplied through .bfloat16().transpose(-2, -1) (refused before:
    # "multiplies by transpose_2, not an expert weight parameter"); any dim may be the experts' so long as views
    # and casts bring it to the grouped matmul's dim 0 whole. Gate and up cast the rows apart: the rows dispatched
    # are the fp32 rows both cast
    (block,) = _blocks()
    assert not block.refused and block.num_experts == 4
    assert block.expert_dims == {"w1": 2, "w2": 1, "w3": 0}
    assert block.rows.op == "placeholder" and block.rows.name == "rows"


@pytest.mark.parametrize("how,message", [
    ("reshape", r"multiplies by contiguous at test_expert_parallel\.py:\d+, which is not an expert weight parameter"),
    ("weight read", r"the expert weight w3 is also read by sum_1 \(aten::sum\) at test_expert_parallel\.py:\d+"),
    ("rows read", r"to_\d+ \(aten::to\) at test_expert_parallel\.py:\d+ runs on the rows between the expert matmuls "
                  r"and is also read by to_\d+ \(aten::to\) at test_expert_parallel\.py:\d+ outside them")])
def test_what_expert_parallelism_cannot_move_is_named_with_its_line(how, message):
    (block,) = _blocks(how)
    assert re.search(message, block.refused), block.refused


def test_the_rows_are_placed_through_the_block_by_the_shared_rules():
    # every value from the rows to the last grouped matmul is placed on the rows' dim (ep_walk); a per-row norm
    # between the matmuls (a mean over the features) carries them
    (block,) = _blocks("row norm")
    assert not block.refused
    assert block.out in block.placed and block.rows in block.placed
    assert any(n.target is torch.ops.aten.mean.dim for n in block.placed)


@pytest.mark.parametrize("how,message", [
    ("rows summed", r"mean(_\d+)? \(aten::mean\) at test_expert_parallel\.py:\d+ reduces over the rows between the "
                    r"expert matmuls \(a partial mean on each ep rank\)"),
    ("rows flipped", r"flip \(aten::flip\) at test_expert_parallel\.py:\d+ reads across the rows between the expert "
                     r"matmuls \(along the rows\)"),
    ("rows viewed", r"view \(aten::view\) at test_expert_parallel\.py:\d+ runs between the expert matmuls and is "
                    r"not a per-row op")])
def test_an_op_across_the_rows_between_the_expert_matmuls_is_refused_by_name(how, message):
    (block,) = _blocks(how)
    assert re.search(message, block.refused), block.refused
