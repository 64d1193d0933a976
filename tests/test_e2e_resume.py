"""Tier 3: AdamW with FQN parameter groups and an LR schedule, checkpoints that resume, activation checkpointing.

One 2-rank split of a tied-embedding LM (the tied weight lives on both ranks) trained with the model file's
AdamW groups and LambdaLR: 6 uninterrupted steps equal eager training; 3 steps + a resume for 3 more (past a
cut-off save) give exactly the same parameters; bad resumes fail on every rank and write nothing (an empty
--resume folder is a first start: tests/test_e2e_jobs.py).
"""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.runtime.optim import build_optimizer, build_scheduler
from util import assert_state_close, assert_trained, model_path, run_ok, torchrun

MODEL = model_path("tied_lm_adamw")


def eager_adamw(path: str, steps: int) -> dict:
    """The unsplit model trained with the model file's optimizer(named_params) and lr_scheduler(optimizer)."""
    model_file = load_model_file(path)
    module = model_file.module
    model = model_file.model()
    optimizer = build_optimizer(module, list(model.named_parameters()))
    scheduler = build_scheduler(module, optimizer)
    for step in range(steps):
        args, kwargs, target = module.batch(step)
        module.loss_fn(model(*args, **kwargs), target).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def split_out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tied_adamw") / "out")
    split_model(MODEL, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    return out


@pytest.fixture(scope="module")
def three_step_checkpoint(split_out, tmp_path_factory):
    """A --checkpoint-dir after 3 steps of the 2-rank run (copy it before changing it)."""
    checkpoints = tmp_path_factory.mktemp("three_steps") / "ckpt"
    first = run_ok(split_out, 2, "--steps", "3", "--checkpoint-dir", str(checkpoints), "--save-every", "3")
    assert (checkpoints / "step_3" / "COMPLETE").is_file(), first.stdout
    return checkpoints


def test_adamw_groups_resume_and_activation_checkpointing_match_eager(split_out, three_step_checkpoint, tmp_path):
    expected = eager_adamw(MODEL, 6)
    whole = str(tmp_path / "whole.pt")
    run_ok(split_out, 2, "--steps", "6", "--save", whole, "--activation-checkpointing", "in-flight")
    assert_trained(torch.load(whole), MODEL)
    assert_state_close(torch.load(whole), expected)

    checkpoints = tmp_path / "ckpt"
    shutil.copytree(three_step_checkpoint, checkpoints)
    (checkpoints / "step_5.tmp").mkdir()  # a save killed before its rename
    (checkpoints / "step_4").mkdir()  # a folder without the completion marker
    resumed = str(tmp_path / "resumed.pt")
    result = run_ok(split_out, 2, "--steps", "6", "--resume", str(checkpoints), "--save", resumed,
                    "--activation-checkpointing", "full")
    assert "ignoring incomplete checkpoint" in result.stderr and "step_4" in result.stderr
    assert "step 4/6" in result.stdout and "step 1/6" not in result.stdout
    whole_state, resumed_state = torch.load(whole), torch.load(resumed)
    differ = [k for k in whole_state if not torch.equal(whole_state[k], resumed_state[k])]
    assert not differ, f"3 + 3 resumed steps differ from 6 uninterrupted ones in {differ}"

    # the same checkpoint resumed by another split: 3 stages on 1 rank (plain python, no torchrun)
    one_rank = str(tmp_path / "one_rank")
    split_model(MODEL, one_rank, schedule="interleaved-1f1b", num_microbatches=4,
                split_points=["layers.1", "layers.3"], layout=Layout(pp=1))
    other_split = str(tmp_path / "other_split.pt")
    result = subprocess.run([sys.executable, os.path.join(one_rank, "run.py"), "--steps", "6", "--resume",
                             str(checkpoints), "--save", other_split], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_state_close(torch.load(other_split), expected)


def _listing(folder) -> dict:
    return {os.path.join(root, name): os.path.getmtime(os.path.join(root, name))
            for root, _dirs, files in os.walk(folder) for name in files}


def test_bad_resume_fails_every_rank_and_writes_nothing(split_out, three_step_checkpoint, tmp_path):
    checkpoints = tmp_path / "ckpt"
    shutil.copytree(three_step_checkpoint, checkpoints)
    before = _listing(checkpoints)
    other = str(tmp_path / "other")
    split_model(model_path("residual_mlp_lm"), other, schedule="1f1b", num_microbatches=2,
                split_points=["layers.2"], layout=Layout(pp=2))
    sgd = str(tmp_path / "sgd")  # same FQNs as tied_lm_adamw, but SGD
    split_model(model_path("tied_lm"), sgd, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    cases = [
        (other, checkpoints, "is from another model"),
        (sgd, checkpoints, "holds AdamW optimizer state but this run builds SGD"),
    ]
    for out, resume_from, message in cases:
        saved = str(tmp_path / "never.pt")
        result = torchrun(out, 2, "--steps", "4", "--resume", str(resume_from), "--save", saved,
                          "--checkpoint-dir", str(resume_from), "--save-every", "1")
        assert result.returncode != 0, result.stdout
        for rank in (0, 1):  # each rank finds it, or is told by the rank that found it first (a loaded machine)
            found = rf"\[tracepp rank {rank}\] (error|stopping because rank \d failed): [^\n]*{re.escape(message)}"
            assert re.search(found, result.stderr), result.stderr[-3000:]
        assert not os.path.exists(saved)
        assert _listing(checkpoints) == before


def test_scheduler_that_raises_stops_every_rank_and_keeps_earlier_checkpoints(tmp_path):
    source = open(MODEL).read().replace("lambda step: min(1.0, (step + 1) / 2) * 0.9 ** step",
                                        "lambda step: 1.0 / (2 - step)")  # ZeroDivisionError at the 2nd step
    path = tmp_path / "raising_scheduler.py"
    path.write_text(source)
    out = str(tmp_path / "out")
    split_model(str(path), out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    checkpoints = tmp_path / "ckpt"
    saved = str(tmp_path / "never.pt")
    result = torchrun(out, 2, "--steps", "4", "--checkpoint-dir", str(checkpoints), "--save-every", "1",
                      "--save", saved)
    assert result.returncode != 0, result.stdout
    message = "the LR scheduler LambdaLR raised ZeroDivisionError at step 2"
    for rank in (0, 1):
        assert f"[tracepp rank {rank}] error: {message}" in result.stderr, result.stderr[-3000:]
    assert sorted(os.listdir(checkpoints)) == ["step_1"] and (checkpoints / "step_1" / "COMPLETE").is_file()
    assert not os.path.exists(saved)
