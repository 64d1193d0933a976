"""Mixed precision (issue 58), tiers 1 and 2: the policy's plain data, the test reference against FSDP2 itself, the
compute copies, and the memory a plan counts for them.

* ``util.eager_mixed_precision`` (the reference the tier-3 matrix in ``test_e2e_precision.py`` holds the pipeline
  to) equals ``fully_shard`` and ``replicate`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on
  one process, with gradient accumulation over microbatches, bit for bit;
* ``CastWeights`` adds each backward's bf16 gradients into fp32 masters (what FSDP2 does with ``reduce_dtype``);
* a run precision the stage code was not traced for is refused naming what works; fp8 is refused on CPU and at a
  split planned for CPU; a folder split before the policy existed ran under autocast and still does;
* the gathered copy a plan counts under ``--dp 2`` is bf16's (half of fp32's) while the weights, gradients and
  optimizer state stay fp32's (Qwen2, the issue's example); the tuner counts the same.
"""
import json
import os

import pytest
import torch

from tracepp.runtime import precision
from tracepp.runtime.run_options import RunOptions
from util import eager_mixed_precision, model_path

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")


def test_the_reference_is_fsdp2s_mixed_precision_recipe(tmp_path):
    import torch.distributed as dist
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tracepp.modelfile import load_model_file

    path = model_path("hf_llama")
    expected, _losses = eager_mixed_precision(path, 2, 2, separate_tied=False)  # one copy of the tied weight
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for engine in ("fully_shard", "replicate"):
            model_file = load_model_file(path)
            module, model = model_file.module, model_file.model()
            if engine == "fully_shard":
                fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
            else:
                replicate(model, mesh=mesh, mp_policy=policy)
            optimizer = module.optimizer(list(model.parameters()))
            for step in range(2):
                (idx,), kwargs, target = module.batch(step)
                for mb in range(2):  # gradients accumulated over two microbatches, reduced in the last backward
                    last = mb == 1
                    model.set_is_last_backward(last)
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                    output = model(idx[2 * mb:2 * mb + 2], **kwargs)
                    output.logits = output.logits.float()
                    (module.loss_fn(output, target[2 * mb:2 * mb + 2]).float() * 0.5).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            found = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
            assert {k: torch.equal(found[k], expected[k]) for k in expected} == dict.fromkeys(expected, True), engine
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def test_cast_weights_accumulate_each_backward_in_fp32():
    master = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    cast = precision.CastWeights([master, frozen], torch.bfloat16)
    copy, fixed = cast.swap([master, frozen])
    assert copy.dtype == torch.bfloat16 and copy.is_leaf and copy.requires_grad and not fixed.requires_grad
    assert cast.swap([master])[0] is copy  # once per step, not per call
    small = 2.0 ** -10  # below bf16's resolution at 1.0: summed in bf16 it would vanish
    for grad in (torch.tensor([1.0, 1.0, 1.0]), torch.full((3,), small)):
        (copy * grad.to(torch.bfloat16)).sum().backward()
        cast.accumulate()
        assert copy.grad is None
    assert master.grad.dtype == torch.float32 and torch.equal(master.grad, torch.full((3,), 1.0 + small))
    cast.release()
    assert cast.copies is None and cast.swap([master])[0] is not copy


def test_a_run_precision_the_stage_code_was_not_traced_for_is_refused():
    params = RunOptions(precision="bf16")
    assert precision.resolve(params, None) == ("bf16", "params")
    assert precision.resolve(params, "fp8") == ("fp8", "params")  # the same bf16 stage code, float8 linears
    with pytest.raises(ValueError, match=r"traced with bfloat16 parameters \(tracepp split --precision bf16, "
                                         r"--mixed-precision params\), so it runs at --precision bf16 or fp8; for "
                                         r"--precision fp32 re-split with it"):
        precision.resolve(params, "fp32")
    fp32 = RunOptions()
    assert precision.resolve(fp32, "bf16") == ("bf16", "autocast")  # fp32 stage code: autocast, as before
    with pytest.raises(ValueError, match="--precision fp8 runs the stage code traced with bf16 parameters"):
        precision.resolve(fp32, "fp8")
    autocast = RunOptions(precision="bf16", mixed_precision="autocast")
    assert precision.resolve(autocast, None) == ("bf16", "autocast")
    assert precision.resolve(autocast, "fp32") == ("fp32", "autocast")


def test_fp8_is_refused_on_cpu_naming_what_works():
    with pytest.raises(ValueError, match="--precision fp8 .* with --mixed-precision autocast use --precision bf16"):
        RunOptions(precision="fp8", mixed_precision="autocast").check()
    with pytest.raises(ValueError, match="--precision fp8 trains torchao's float8 linears on a CUDA GPU .* plan with "
                                         "--device cuda, or use --precision bf16"):
        RunOptions(precision="fp8", device="cpu").check()
    RunOptions(precision="fp8", device="cuda").check()  # planned here for a GPU: fine
    assert "use --precision bf16" in precision.fp8_problem(torch.device("cpu"))


def test_a_folder_split_before_the_policy_ran_under_autocast():
    old = RunOptions.from_json({"precision": "bf16", "activation_checkpointing": "none"})
    assert old.mixed_precision == "autocast" and old.traced_dtype() is None
    assert RunOptions.from_json(None).mixed_precision == "params"  # no record at all: fp32, nothing to cast
    assert RunOptions(precision="bf16").traced_dtype() == torch.bfloat16
    assert RunOptions(precision="fp8").traced_dtype() == torch.bfloat16


def test_the_gathered_copy_is_counted_in_the_compute_dtype(monkeypatch):
    """The issue's example: Qwen2 at --dp 2 counted the same gathered copy at fp32 and at bf16. Now bf16's is half,
    while the parameters, gradients and optimizer state a rank holds stay fp32's; the tuner counts the same."""
    from tracepp.costs.search import compute_copy_share, stage_memory
    from tracepp.driver import check_model
    from tracepp.runtime.mesh import Layout

    monkeypatch.syspath_prepend(ZOO)
    path, layout = os.path.join(ZOO, "qwen2.py"), Layout(pp=2, dp=2)
    found = {}
    for name in ("fp32", "bf16"):
        manifest = check_model(path, num_microbatches=2, layout=layout,
                               run=RunOptions(precision=name, optimizer="adamw"))
        found[name] = manifest
    fp32, bf16 = (found[name]["memory"] for name in ("fp32", "bf16"))
    for old, new in zip(fp32["stages"], bf16["stages"]):
        assert old["unsharded_bytes"] > 0 and new["unsharded_bytes"] * 2 == old["unsharded_bytes"]
        assert (new["param_bytes"], new["grad_bytes_at_rest"], new["grads"]) == (
            old["param_bytes"], old["grad_bytes_at_rest"], old["grads"])
    for old, new in zip(fp32["ranks"], bf16["ranks"]):
        assert new["optimizer"]["state_bytes"] == old["optimizer"]["state_bytes"]
        assert new["peak_bytes"] < old["peak_bytes"]
    assert compute_copy_share(found["fp32"]) is None and compute_copy_share(found["bf16"]) == 0.5
    split = tuple(segment["stage"] for segment in found["bf16"]["segments"])
    for name, share in (("fp32", 1.0), ("bf16", 0.5)):
        figures, _state = stage_memory(found[name], split, 2, True, 8, layout=layout)
        for stage, figure in figures.items():
            assert figure["unsharded_bytes"] == pytest.approx(share * 2 * figure["param_bytes"], rel=0.01)
    json.dumps(found["bf16"]["memory"])  # plain data
