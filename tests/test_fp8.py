"""``--precision fp8`` (issue 58) on CPU, where torchao's float8 matmuls run emulated (its own test mode): needs the
optional ``torchao`` package, skipped without it (the product runs without torchao and refuses fp8 by name then;
``test_precision.py`` checks the refusals). The GPU check is ``benchmarks/fp8_step.py``.

* ``Float8Linears`` (torchao's float8 matmul for the stage code's ``aten.linear`` of a parameter, no module) equals
  torchao's ``Float8Linear`` forward and backward bit for bit, tensorwise and rowwise;
* a pipeline step at fp8 (every stage in one process) equals eager training of the unsplit model converted by
  torchao's ``convert_to_float8_training`` under the bf16 params recipe;
* under FSDP with tensorwise scaling the linear weights are torchao's float8-gathered weights, a tied embedding
  not (it is no linear's weight on its stage).
"""
import copy
import dataclasses

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8")

from tracepp.driver import split_model  # noqa: E402
from tracepp.runtime import precision  # noqa: E402
from tracepp.runtime.mesh import Layout  # noqa: E402
from tracepp.runtime.run_options import RunOptions  # noqa: E402
from util import eager_mixed_precision, max_state_diff, model_path  # noqa: E402


def _emulated(recipe: str):
    from torchao.float8.config import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_equal_torchaos_float8_linear(recipe):
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48).to(torch.bfloat16)
    theirs = Float8Linear.from_float(copy.deepcopy(linear), config=_emulated(recipe))
    mine = precision.Float8Linears(recipe, emulate=True)
    x = torch.randn(4, 8, 32, dtype=torch.bfloat16)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight, bias = (t.detach().clone().requires_grad_() for t in (linear.weight, linear.bias))
    expected, found = theirs(a), mine.linear(b, weight, bias)
    expected.float().pow(2).sum().backward()
    found.float().pow(2).sum().backward()
    assert torch.equal(found, expected) and torch.equal(b.grad, a.grad)
    assert torch.equal(weight.grad, theirs.weight.grad) and torch.equal(bias.grad, theirs.bias.grad)
    assert not torch.equal(found, torch.nn.functional.linear(x, linear.weight, linear.bias))  # float8 rounding


@pytest.fixture
def emulated_fp8(monkeypatch):
    """The runtime's fp8 on CPU: its refusal lifted and torchao's matmuls emulated, for this test only."""
    monkeypatch.setattr(precision, "fp8_problem", lambda device: None)
    real = precision.Float8Linears
    monkeypatch.setattr(precision, "Float8Linears", lambda recipe: real(recipe, emulate=True))


def test_fp8_pipeline_steps_equal_torchaos_recipe(tmp_path, emulated_fp8):
    from torchao.float8 import convert_to_float8_training

    from tracepp.runtime.pipeline import Pipeline
    from tracepp.modelfile import load_model_file

    path, out = model_path("hf_llama"), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2),
                           run=RunOptions(precision="fp8", device="cuda"))
    assert manifest["run_options"]["precision"] == "fp8"
    pipe = Pipeline(out, all_stages=True)
    assert (pipe.precision, pipe.mixed_precision) == ("fp8", "params")
    module = load_model_file(path).module
    optimizer = module.optimizer(pipe.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(2):
            pipe.step(*module.batch(step))
            optimizer.step()
            pipe.zero_grad()
    finally:
        torch.set_num_threads(threads)
    expected, _losses = eager_mixed_precision(
        path, 2, 2, convert=lambda model: convert_to_float8_training(model, config=_emulated("tensorwise")))
    found = {name: tensor.detach() for name, tensor in pipe.state_dict().items()}
    found["lm_head.weight"] = found["model.embed_tokens.weight"] = found.get("lm_head.weight",
                                                                            found.get("model.embed_tokens.weight"))
    bf16, _ = eager_mixed_precision(path, 2, 2)
    assert max_state_diff(found, expected) <= 1e-6  # the same recipe: fp32 rounding of the tied weight's sum
    assert max_state_diff(found, bf16) > 1e-5  # and not bf16's


def test_fsdp_tensorwise_wraps_the_linear_weights_for_a_float8_gather(tmp_path, emulated_fp8):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from tracepp.runtime.pipeline import Pipeline

    out = str(tmp_path / "out")
    split_model(model_path("hf_llama"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2),
                run=RunOptions(precision="fp8", device="cuda"))
    pipe = Pipeline(out, all_stages=True)  # one process: no FSDP; wrap as the dp path does
    wrapped = pipe.float8.gathered_weights(pipe.stages, pipe.manifest)
    kinds = {name: isinstance(p, WeightWithDynamicFloat8CastTensor) for name, p in pipe.named_parameters()}
    linears = [name for name, is_float8 in kinds.items() if is_float8]
    assert wrapped == len(linears) == 14  # q, k, v, o, gate, up, down of both layers
    assert not kinds["lm_head.weight"]  # the embedding on stage 0 reads the tied weight too: not a float8 gather
