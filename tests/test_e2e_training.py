"""Tier 3: the training loop's features under torchrun on gloo, each compared with the eager equivalent.

Gradient clipping, bf16 mixed precision, non-finite losses, compiled stages, and a user's own loop on the
public ``Pipeline`` API (examples/own_loop.py).
"""
import json
import os
import subprocess
import sys

import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from util import (REPO, TORCHRUN_TIMEOUT_S, assert_state_close, assert_trained, eager_train,
                  model_path, run_ok, torchrun)


def _eager(path: str, steps: int, *, clip=None, autocast=None, microbatches=1, round_before=None,
           skip_steps=(), make_optimizer=None, make_schedule=None):
    """Eager training of the unsplit model on the pipeline's batches. ``clip``: clip_grad_norm_ (returns the
    pre-clip norms too); ``autocast``: forward under torch.autocast in that dtype, loss in fp32;
    ``microbatches``: accumulate over the same chunks the pipeline uses, each loss weighted by its share;
    ``round_before``: a module FQN whose input is rounded to the autocast dtype (what crossing a pipeline
    boundary in that dtype does); ``skip_steps``: steps whose optimizer step is skipped."""
    model_file = load_model_file(path)
    module = model_file.module
    model = model_file.model()
    if round_before is not None:
        model.get_submodule(round_before).register_forward_pre_hook(
            lambda _m, args: (args[0].to(autocast).float(),))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params) if make_optimizer else module.optimizer(params)
    schedule = make_schedule(optimizer) if make_schedule else None
    norms = []
    for step in range(steps):
        args, kwargs, target = module.batch(step)
        for chunk, chunk_target in zip(args[0].tensor_split(microbatches), target.tensor_split(microbatches)):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                output = model(chunk, **kwargs)
            loss = module.loss_fn(output.float(), chunk_target) * (len(chunk) / len(args[0]))
            loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if step not in skip_steps:
            optimizer.step()
        if schedule is not None:
            schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, model


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def test_clip_grad_norm_matches_eager_with_a_tied_weight(tmp_path):
    """Global norm over both ranks with the tied embedding/head counted once, every rank scaled alike."""
    path = model_path("tied_lm")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    ckpt, metrics = str(tmp_path / "ckpt.pt"), str(tmp_path / "m.jsonl")
    clip = 0.5
    result = run_ok(out, 2, "--steps", "3", "--clip-grad-norm", str(clip), "--save", ckpt, "--metrics", metrics)
    expected, norms, _ = _eager(path, 3, clip=clip)
    assert min(norms) > clip, "the norm must exceed MAX or clipping is not exercised"
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, expected)
    reported = [json.loads(line)["grad_norm"] for line in open(metrics)]
    torch.testing.assert_close(torch.tensor(reported), torch.tensor(norms), rtol=1e-5, atol=0)
    assert f"grad norm {norms[0]:.4f}" in result.stdout


def test_bf16_matches_eager_autocast(tmp_path):
    """``--precision bf16`` against eager ``torch.autocast(dtype=torch.bfloat16)`` training, loss in fp32.

    Exact part: the pipeline equals eager autocast over the same 4 microbatches with the boundary value
    (input of layers.2) rounded to bf16, within the fp32 tolerance 2e-5 (observed: identical). This proves
    each stage runs under autocast as eager does, and that the boundary travels in bf16: without that
    rounding eager differs by about 9e-5, beyond 2e-5, so the check would fail if the wire stayed fp32.
    Tolerance part: against plain full-batch eager autocast the pipeline rounds in two more places (the
    boundary activation and its gradient, and each microbatch's bf16 weight-gradient matmul before the
    fp32 accumulation), both rounding to bf16's 8 significant bits like autocast itself; so the distance
    is of the order of autocast's own effect on training (eager fp32 vs eager bf16): at most 3 times it.
    """
    path = model_path("residual_mlp_lm")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, split_points=["layers.2"], layout=Layout(pp=2))
    ckpt = str(tmp_path / "ckpt.pt")
    result = run_ok(out, 2, "--steps", "3", "--precision", "bf16", "--save", ckpt)
    assert "compute bf16 (autocast per stage), boundary tensors sent as bf16, loss fp32" in result.stdout
    saved = torch.load(ckpt)
    assert all(t.dtype == torch.float32 for t in saved.values()), "master weights stay fp32"
    same_rounding, _, _ = _eager(path, 3, autocast=torch.bfloat16, microbatches=4, round_before="layers.2")
    assert_state_close(saved, same_rounding)
    unrounded, _, _ = _eager(path, 3, autocast=torch.bfloat16, microbatches=4)
    assert _max_diff(saved, unrounded) > 2e-5, "the boundary did not travel in bf16"
    full_batch, _, _ = _eager(path, 3, autocast=torch.bfloat16)
    fp32 = eager_train(path, 3)
    assert _max_diff(saved, full_batch) <= 3 * _max_diff(fp32, full_batch)


def test_nonfinite_loss_stops_every_rank_naming_step_microbatch_stage(tmp_path):
    """A NaN embedding row reached only by step 2's microbatch 2: stop names them and stage 0, on both ranks,
    exits non-zero and leaves the old checkpoint; ``skip`` skips exactly that step on every rank."""
    path = model_path("nan_token")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_text("an older checkpoint")
    result = torchrun(out, 2, "--steps", "3", "--save", str(ckpt))
    assert result.returncode != 0
    expected = ("step 2: non-finite loss or gradient norm; loss nan; the output of stage 0 (rank 0; modules embed, "
                "layers.0, layers.1) went non-finite first, at microbatch 2. Nothing was saved.")
    for rank in (0, 1):
        assert f"[tracepp rank {rank}] error: {expected}" in result.stderr, result.stderr[-3000:]
    assert ckpt.read_text() == "an older checkpoint"
    assert "step 3/3" not in result.stdout

    skipped_ckpt, metrics = str(tmp_path / "skipped.pt"), str(tmp_path / "m.jsonl")
    run_ok(out, 2, "--steps", "3", "--on-nonfinite", "skip", "--save", skipped_ckpt, "--metrics", metrics)
    records = [json.loads(line) for line in open(metrics)]
    assert [r.get("skipped", False) for r in records] == [False, True, False]
    expected_state, _, _ = _eager(path, 3, skip_steps=(1,))
    saved = torch.load(skipped_ckpt)
    for name in expected_state:  # the planted NaN row stays NaN in both; everything else equal
        torch.testing.assert_close(saved[name], expected_state[name], atol=2e-5, rtol=0, equal_nan=True)


def test_compiled_stages_match_eager_with_changing_shapes(tmp_path):
    """``--compile`` on a model whose batch and sequence length change every step: equal to eager within
    2e-5 (fp32; inductor may reorder reductions, observed 3e-8), compiled once per stage plus at most once
    more for the step with one-sample microbatches (torch specialises size 1), never per step."""
    path = model_path("dynamic_seq_lm")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    ckpt = str(tmp_path / "ckpt.pt")
    # a peer waits while the other compiles its first step: on a loaded CI machine that exceeds PEER_TIMEOUT_S
    result = torchrun(out, 2, "--steps", "4", "--compile", "--save", ckpt, "--timeout", "280",
                      env_extra={"TORCH_LOGS": "recompiles"},
                      timeout=TORCHRUN_TIMEOUT_S * 2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_state_close(torch.load(ckpt), eager_train(path, 4))
    for rank in (0, 1):
        recompiles = [line for line in result.stderr.splitlines()
                      if line.startswith(f"[rank{rank}]") and "Recompiling function" in line]
        assert len(recompiles) <= 1, "\n".join(recompiles)
    assert os.listdir(os.path.join(out, "compile_cache")), "the inductor cache goes under the output folder"


def test_own_loop_example_with_cosine_schedule(tmp_path):
    """examples/own_loop.py (AdamW, CosineAnnealingLR, clipping, eval_step) on a tied-weight model equals the
    same loop run eagerly on the unsplit model."""
    path = model_path("tied_lm")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    ckpt = str(tmp_path / "own.pt")
    steps, lr, clip = 4, 0.01, 0.5
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(REPO, "examples", "own_loop.py"), out, "--steps", str(steps), "--lr", str(lr),
               "--clip", str(clip), "--save", ckpt]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    expected, norms, model = _eager(
        path, steps, clip=clip, make_optimizer=lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.01),
        make_schedule=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps))
    saved = torch.load(ckpt)
    assert set(expected) - set(saved) == {"embed.weight"}  # the tied weight is saved once, as head.weight
    saved["embed.weight"] = saved["head.weight"]
    assert_trained(saved, path)
    assert_state_close(saved, expected)
    module = load_model_file(path).module
    args, kwargs, target = module.batch(steps)
    with torch.no_grad():
        eval_loss = module.loss_fn(model(*args, **kwargs), target).item()
    line = next(l for l in result.stdout.splitlines() if l.startswith("eval loss"))
    assert abs(float(line.split()[-1]) - eval_loss) < 1e-5, (line, eval_loss)
    assert f"grad norm {norms[-1]:.4f} | lr 0" in result.stdout
