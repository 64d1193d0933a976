"""Tier 2: the public Pipeline API in one process (every stage here, no communication) against the unsplit model."""
import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.runtime import Pipeline, register_step_hook
from tracepp.runtime.pipeline import check_precision
from util import RecomputedOps, model_path


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pipe") / "out")
    split_model(model_path("tied_lm"), out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    return out


def _eager_grads(path: str, step: int):
    module = load_model_file(path).module
    model = module.model()
    args, kwargs, target = module.batch(step)
    loss = module.loss_fn(model(*args, **kwargs), target)
    loss.backward()
    return model, loss.detach()


def test_step_accumulates_the_unsplit_models_gradients(tied_folder):
    path = model_path("tied_lm")
    pipe = Pipeline(tied_folder, all_stages=True)
    model, expected_loss = _eager_grads(path, 0)
    args, kwargs, target = pipe.user.batch(0)
    loss = pipe.step(args, kwargs, target)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=2e-6)
    eager = dict(model.named_parameters())  # the tied weight once, as eager names it
    names = [name for name, _ in pipe.named_parameters()]
    assert len(names) == len(set(names)) == len(eager) and set(names) <= set(dict(
        model.named_parameters(remove_duplicate=False)))
    aliases = {"head.weight": "embed.weight", "embed.weight": "head.weight"}
    for name, param in pipe.named_parameters():
        expected = eager.get(name, eager.get(aliases.get(name)))
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=2e-6)
    # the global norm counts the tied weight once, as clip_grad_norm_ over model.parameters() does
    eager_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(pipe.clip_grad_norm_(0.1), eager_norm, rtol=1e-6, atol=0)
    for name, param in pipe.named_parameters():
        expected = eager.get(name, eager.get(aliases.get(name)))
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=2e-6)
    assert set(pipe.state_dict()) == set(names) | {n for n, _ in model.named_buffers()}
    pipe.zero_grad()
    assert all(p.grad is None for p in pipe.parameters())


def test_eval_step_is_forward_only(tied_folder):
    pipe = Pipeline(tied_folder, all_stages=True)
    module = pipe.user
    args, kwargs, target = module.batch(1)
    loss = pipe.eval_step(args, kwargs, target)
    with torch.no_grad():
        expected = module.loss_fn(module.model()(*args, **kwargs), target)
    torch.testing.assert_close(loss, expected, rtol=0, atol=2e-6)
    assert all(p.grad is None for p in pipe.parameters())
    outputs = pipe.eval_step(args, kwargs)  # no target: the per-microbatch outputs
    assert len(outputs) == 4 and torch.cat(outputs).shape[0] == args[0].shape[0]


def test_step_and_action_hooks(tied_folder):
    pipe = Pipeline(tied_folder, all_stages=True)
    seen, actions = [], []
    remove = register_step_hook(lambda p, step: seen.append((p is pipe, step)))
    pipe.set_action_hook(lambda text, run: (actions.append(text), run()))
    try:
        for step in range(2):
            args, kwargs, target = pipe.user.batch(step)
            pipe.step(args, kwargs, target)
    finally:
        remove()
    assert seen == [(True, 0), (True, 1)]
    per_step = [f"{s}F{m}" for m in range(4) for s in (0, 1)]  # F then B of every stage, per microbatch
    assert [a for a in actions if "F" in a] == per_step * 2 and len(actions) == 2 * 2 * len(per_step)


def test_fp16_and_fp8_refused_on_cpu_and_unknown_precision():
    with pytest.raises(ValueError, match="fp16 needs a GPU .* use --precision bf16 or fp32"):
        check_precision("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="--precision fp8 trains the linears in float8 with torchao, which needs a "
                                         "CUDA GPU of compute capability 8.9 or more .* this job runs on cpu: use "
                                         "--precision bf16"):
        check_precision("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="precision 'fp4' is not one of fp32, bf16, fp16, fp8"):
        check_precision("fp4", torch.device("cpu"))


def test_bf16_step_of_an_hf_llama_matches_eager_autocast(tmp_path):
    """HF code calls ``x.to(dtype)``: export records dtype checks that bf16 autocast would trip (they are
    dropped from stage code). One bf16 step of every stage in one process against eager autocast: the loss
    agrees to bf16 resolution (a few 1e-3 relative: the same ops in the same order, bf16 rounding)."""
    out = str(tmp_path / "out")
    path = model_path("hf_llama")
    split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    pipe = Pipeline(out, all_stages=True, precision="bf16")
    module = pipe.user
    args, kwargs, target = module.batch(0)
    loss = pipe.step(args, kwargs, target)
    model = module.model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(*args, **kwargs)
    expected = module.loss_fn(output, target)
    torch.testing.assert_close(loss.float(), expected.float(), rtol=1e-2, atol=0)


def test_batch_prefetcher_on_cpu_hands_batches_over_in_order():
    from tracepp.runtime.prefetch import BatchPrefetcher

    calls = []

    def produce(step):
        calls.append(step)
        return (torch.full((2,), float(step)),), {}, None

    batches = BatchPrefetcher(produce, torch.device("cpu"))
    for step in range(3):
        (tensor,), _, _ = batches.get(step)
        assert tensor.tolist() == [float(step)] * 2
    assert calls == [0, 1, 2]  # produced in the loop's thread, in order, never ahead


def test_bf16_keeps_autocast_disabled_regions_in_fp32(tmp_path):
    """A ``torch.autocast(enabled=False)`` block (older HF rotary tables) runs in fp32 under --precision bf16,
    as in eager autocast: with it computed in bf16, cos(37 * x @ freq) would be off by far more than 1e-3."""
    out = str(tmp_path / "out")
    path = model_path("autocast_off_region")
    split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    source = open(f"{out}/rank1.py").read()
    assert "_enter_autocast(RUN_DEVICE.type, None, False, None)" in source
    pipe = Pipeline(out, all_stages=True, precision="bf16")
    module = pipe.user
    args, kwargs, target = module.batch(0)
    loss = pipe.step(args, kwargs, target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module.loss_fn(module.model()(*args, **kwargs), target)
    torch.testing.assert_close(loss.float(), expected.float(), rtol=1e-3, atol=0)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pipe_llama") / "out")
    split_model(model_path("hf_llama"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    return out


@pytest.mark.parametrize("mode", ["full", "selective", "every-2", "full,selective"])
def test_every_checkpointing_mode_gives_the_unsplit_models_gradients(llama_folder, mode):
    # full recomputes block by block (each model.layers.N function of the rank script), selective keeps the
    # matmul/attention outputs (torchtitan's op policy), every-2 checkpoints every second block, a list per stage
    pipe = Pipeline(llama_folder, all_stages=True, activation_checkpointing=mode)
    assert pipe.checkpointing, mode
    model, expected_loss = _eager_grads(model_path("hf_llama"), 0)
    args, kwargs, target = pipe.user.batch(0)
    loss = pipe.step(args, kwargs, target)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=2e-6)
    eager = dict(model.named_parameters(remove_duplicate=False))  # a tied head under either of its names
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(param.grad, eager[name].grad, rtol=0, atol=2e-6)


def test_the_pipeline_runs_the_precision_and_checkpointing_the_split_planned(tmp_path):
    """Issue 59: ``Pipeline(folder)`` takes them from ``run_options`` as run.py does; an explicit argument wins."""
    from tracepp.runtime.run_options import RunOptions

    out = str(tmp_path / "out")
    split_model(model_path("hf_llama"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2),
                run=RunOptions(precision="bf16", mixed_precision="autocast", activation_checkpointing="selective,none"))
    pipe = Pipeline(out, all_stages=True)  # autocast: stage code traced in fp32, so fp32 may be asked for below
    assert pipe.precision == "bf16" and pipe.compute_dtype is torch.bfloat16
    assert pipe.checkpointing == {0: "selective"} and pipe.run_differs == []
    args, kwargs, target = pipe.user.batch(0)
    with RecomputedOps() as counter:
        pipe.step(args, kwargs, target)
    assert counter.recomputed > 0  # stage 0's norms ran again in backward
    plain = Pipeline(out, all_stages=True, precision="fp32", activation_checkpointing="none")
    assert plain.precision == "fp32" and plain.checkpointing == {}
    assert plain.run_differs == ["precision fp32 (planned bf16)",
                                 "activation checkpointing none (planned selective,none)"]
    with RecomputedOps() as counter:
        plain.step(args, kwargs, target)
    assert counter.recomputed == 0
