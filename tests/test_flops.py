"""The planner sees all the compute: FLOPs counted per node of the traced graph (split.cost.count_flops).

Tier 1 and 2, one process: the summed stage FLOPs equal an eager count of the same microbatch (torch's
FlopCounterMode with the formulas it lacks: CPU sdpa and grouped matmuls) for a dense Llama and three MoE models
(Mixtral, Qwen3-MoE, DeepSeek-V3, whose experts run as grouped matmuls in transformers 5); the formulas on known
shapes; an op that cannot be re-run costs only its own count; an op that does work without a formula is named in
one warning; a data-dependent size is priced at its bound and recorded."""
import os
import subprocess
import sys

import pytest
import torch

from tracepp.driver import check_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.split import cost
from util import model_path, trace_and_split

HERE = os.path.dirname(os.path.abspath(__file__))
ZOO = os.path.join(HERE, "zoo")


def _eager_flops(path: str) -> int:
    model_file = load_model_file(path)
    model = model_file.model()
    with torch.no_grad(), cost.eager_flop_counter() as counter:
        model(*model_file.example_inputs(), **model_file.example_kwargs())
    return counter.get_total_flops()


@pytest.mark.parametrize("path", [model_path("hf_llama"), os.path.join(ZOO, "mixtral.py"),
                                  os.path.join(ZOO, "qwen3_moe.py"), os.path.join(ZOO, "deepseek_v3.py")],
                         ids=["llama", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_stage_flops_sum_to_the_eager_count(path):
    pytest.importorskip("transformers")
    manifest = check_model(path, num_microbatches=1, layout=Layout(pp=2))  # one microbatch = the example batch
    counted = sum(stage["forward_flops"] for stage in manifest["stages"])
    eager = _eager_flops(path)
    assert abs(counted - eager) <= 0.03 * eager, (counted, eager)
    assert all(stage["forward_flops"] > 0 for stage in manifest["stages"])
    assert manifest["flop_count"] == {"no_formula": {}, "failed": {}, "assumed": {}, "warnings": []}


def test_dense_and_moe_layers_are_priced_apart():
    pytest.importorskip("transformers")
    _model_file, _traced, graph = trace_and_split(os.path.join(ZOO, "deepseek_v3.py"),
                                                  split_points=["model.layers.1", "model.layers.2"])
    per_stage = [cost.forward_flops(stage) for stage in graph.stages]
    assert per_stage[0] != per_stage[1] and min(per_stage) > 0, per_stage  # dense layer 0 vs MoE layer 1


def test_formulas_on_known_shapes():
    mat_a, mat_b = torch.empty(10, 6), torch.empty(4, 6, 5)  # 10 routed rows, 4 experts of 6 -> 5
    assert cost._grouped_mm_flops(mat_a, mat_b, torch.tensor([3, 5, 8, 10]), out=torch.empty(10, 5)) == 2 * 10 * 6 * 5
    batched = cost._grouped_mm_flops(torch.empty(4, 3, 6), mat_b, out=torch.empty(4, 3, 5))
    assert batched == 4 * 2 * 3 * 6 * 5
    q, k, v = torch.empty(2, 8, 16, 32), torch.empty(2, 2, 24, 32), torch.empty(2, 2, 24, 40)  # GQA: 8 q heads
    assert cost._attention_flops(q, k, v) == 2 * 2 * 8 * 16 * 24 * (32 + 40)
    # the same as torch's own sdpa formula where torch has one
    from torch.utils.flop_counter import sdpa_flop_count
    assert cost._attention_flops(q, torch.empty(2, 8, 24, 32), torch.empty(2, 8, 24, 40)) == \
        sdpa_flop_count(q.shape, (2, 8, 24, 32), (2, 8, 24, 40))


def test_an_op_that_cannot_be_rerun_costs_only_its_own_count():
    path = model_path("custom_matmul")
    model_file, _traced, graph = trace_and_split(path)
    fragile = model_file.module.FRAGILE
    whole = [cost.count_flops(stage.graph) for stage in graph.stages]
    fragile["fail"] = True
    try:
        broken = [cost.count_flops(stage.graph) for stage in graph.stages]
    finally:
        fragile["fail"] = False
    assert broken[0].failed == {"tracepp_test::scaled_matmul": 1}
    linear = {name: flops for name, flops in whole[0].by_node.items() if flops}
    assert linear and all(broken[0].by_node[name] == flops for name, flops in linear.items())
    assert sum(broken[1].by_node.values()) == sum(whole[1].by_node.values()) == 2 * 8 * 32 * 4


def test_an_op_without_a_formula_is_named_in_one_warning(tmp_path):
    out = str(tmp_path / "out")
    result = subprocess.run([sys.executable, "-m", "tracepp", "split", model_path("custom_matmul"), "-o", out,
                             "--ranks", "2"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "FLOP" in line]
    assert lines == ["warning: no FLOP formula for tracepp_test::scaled_matmul (1 node); counted as 0"], result.stderr
    assert "Traceback" not in result.stderr
    import json
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["flop_count"]["no_formula"] == {"tracepp_test::scaled_matmul": 1}


def test_a_data_dependent_size_is_priced_at_its_bound_and_recorded():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    tokens = env.create_unbacked_symint()
    torch._check(tokens >= 0)
    torch._check(tokens <= 64)
    assumed = {}
    assert cost._concrete(tokens * 10, assumed) == 640
    assert assumed == {str(tokens): {"expected": 64, "why": "data-dependent size, at most 64: priced at that bound"}}
