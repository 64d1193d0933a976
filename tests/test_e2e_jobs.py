"""Tier 3: a job a person can leave running, under torchrun on 2 CPU ranks (gloo).

Token files (``--data``/``--eval-data``) train equal to eager training on the same windows, and the validation
loss equals eager's; K steps + ``--resume auto`` for K more equal 2K uninterrupted steps; TensorBoard and
``--metrics`` record every step; a rank killed with SIGKILL under ``--max-restarts`` comes back and ends equal;
SIGUSR1 to one rank and SIGTERM to torchrun (and to run.py as its own launcher) save one checkpoint and exit 0,
and the resumed job ends equal; a damaged latest checkpoint falls back to the previous one; a full disk fails
the save with a message and leaves the previous checkpoint intact. A mixture of llm.c and .npy shards in epoch
order trains equal to eager, resumes bit for bit, and a shard rewritten since the checkpoint is named and then
accepted with --accept-data-change.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.runtime.data import EvalBatches, TokenBatches
from util import PEER_TIMEOUT_S, TORCHRUN_TIMEOUT_S, assert_state_close, model_path, run_ok, torchrun

MODEL = model_path("job_lm")
STEPS = 6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The split (2 ranks, 1F1B), token files, and one uninterrupted 6-step run saved for comparison."""
    root = tmp_path_factory.mktemp("job")
    out = str(root / "out")
    split_model(MODEL, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    rng = np.random.default_rng(0)
    train, val = str(root / "train.bin"), str(root / "val.npy")
    rng.integers(0, 48, 5000).astype(np.uint16).tofile(train)
    np.save(val, rng.integers(0, 48, 800).astype(np.int32))
    whole = str(root / "whole.pt")
    metrics, board = str(root / "metrics.jsonl"), str(root / "tb")
    result = run_ok(out, 2, "--steps", str(STEPS), "--data", train, "--seed", "3", "--eval-data", val,
                    "--eval-every", "3", "--eval-batches", "2", "--save", whole, "--metrics", metrics,
                    "--tensorboard", board)
    return {"root": root, "out": out, "train": train, "val": val, "whole": whole, "metrics": metrics,
            "board": board, "stdout": result.stdout}


def _eager(job, steps):
    """The unsplit model trained on the windows --data --seed 3 reads, and its validation losses."""
    manifest = json.load(open(os.path.join(job["out"], "manifest.json")))
    model_file = load_model_file(MODEL)
    module, model = model_file.module, model_file.model()
    optimizer = module.optimizer(list(model.parameters()))
    source = TokenBatches(job["train"], manifest, seed=3)
    evals = EvalBatches(job["val"], manifest, 2)
    val = {}
    for step in range(steps):
        (inputs,), _kwargs, target = source(step)
        module.loss_fn(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                losses = [float(module.loss_fn(model(x), y)) for (x,), _k, y in evals]
            val[step + 1] = sum(losses) / len(losses)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, val


def test_token_data_validation_and_logs_match_eager(job):
    expected, val = _eager(job, STEPS)
    assert_state_close(torch.load(job["whole"]), expected)
    records = [json.loads(line) for line in open(job["metrics"])]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(STEPS))
    for record in steps:
        for field in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
            assert record[field] is not None and record[field] > 0, (field, record)
    measured = {r["step"] + 1: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(measured) == [3, 6]
    for step, value in val.items():
        assert abs(measured[step] - value) < 1e-5, (step, measured[step], value)
    assert "--data wins" not in job["stdout"] and "data: " in job["stdout"]
    assert f"step {STEPS}/{STEPS} | loss" in job["stdout"] and "tok/s | elapsed 0:00:" in job["stdout"]
    assert "eta 0:" in job["stdout"] and "eval after step 3 | val_loss" in job["stdout"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(job["board"])
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s", "val/loss"):
        assert tag in tags, tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert abs(events.Scalars("train/loss")[-1].value - steps[-1]["loss"]) < 1e-6


def test_resume_auto_starts_then_continues_equal_to_uninterrupted(job, tmp_path):
    checkpoints = str(tmp_path / "ckpt")  # does not exist yet: the same command serves the first start
    common = ["--data", job["train"], "--seed", "3", "--checkpoint-dir", checkpoints, "--save-every", "1",
              "--keep-last", "2", "--resume", "auto"]
    first = run_ok(job["out"], 2, "--steps", "3", *common)
    assert "no checkpoint yet; starting from step 0" in first.stdout
    assert sorted(os.listdir(checkpoints)) == ["step_2", "step_3"]  # --keep-last 2
    resumed = str(tmp_path / "resumed.pt")
    second = run_ok(job["out"], 2, "--steps", str(STEPS), *common, "--save", resumed)
    assert "resumed from" in second.stdout and "step 4/6" in second.stdout and "step 3/6" not in second.stdout
    assert_state_close(torch.load(resumed), torch.load(job["whole"]), atol=0)
    other_seed = torchrun(job["out"], 2, "--steps", "7", *common[:2], "--seed", "4", *common[4:])
    assert other_seed.returncode != 0 and "with --seed 3; this run reads" in other_seed.stderr, other_seed.stderr


def test_killed_rank_restarts_and_ends_equal(job, tmp_path):
    checkpoints = str(tmp_path / "ckpt")
    saved = str(tmp_path / "restarted.pt")
    env = {"JOB_KILL_AT": "3", "JOB_RANK": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts", "1", os.path.join(job["out"], "run.py"), "--timeout", str(PEER_TIMEOUT_S),
               "--steps", str(STEPS), "--data", job["train"], "--seed", "3", "--checkpoint-dir", checkpoints,
               "--save-every", "2", "--resume", "auto", "--save", saved]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from" in result.stdout and "step_2 (step 2)" in result.stdout, result.stdout
    assert_state_close(torch.load(saved), torch.load(job["whole"]), atol=0)


@pytest.mark.parametrize("signal_name,to", [("USR1", "self"), ("TERM", "torchrun")])
def test_signal_saves_one_checkpoint_and_resume_ends_equal(job, tmp_path, signal_name, to):
    checkpoints = str(tmp_path / "ckpt")
    common = ["--data", job["train"], "--seed", "3", "--checkpoint-dir", checkpoints, "--resume", "auto"]
    env = {"JOB_SIGNAL_AT": "2", "JOB_RANK": "0", "JOB_SIGNAL": signal_name, "JOB_SIGNAL_TO": to}
    stopped = torchrun(job["out"], 2, "--steps", str(STEPS), *common, env_extra=env, real=True)  # the signal may go to the agent
    assert (stopped.returncode == 0) == (to == "self"), stopped.stderr[-3000:]
    assert f"stopped by SIG{signal_name}" in stopped.stdout or "stopped by a signal" in stopped.stdout, stopped.stdout
    assert "Traceback" not in stopped.stdout and "tracepp rank" not in stopped.stderr, stopped.stderr[-3000:]
    saved = os.listdir(checkpoints)
    if to == "self":  # a rank's own handler runs at once: the step in flight (the 3rd) ends, then one save
        assert saved == ["step_3"], saved
    else:  # torchrun forwards the signal when its monitor loop sees it: one save, at the step the ranks agreed on
        assert len(saved) == 1 and 3 <= int(saved[0].split("_")[1]) < STEPS, saved
    resumed = str(tmp_path / "resumed.pt")
    result = run_ok(job["out"], 2, "--steps", str(STEPS), *common, "--save", resumed)
    assert "resumed from" in result.stdout
    assert_state_close(torch.load(resumed), torch.load(job["whole"]), atol=0)


def test_launcher_mode_sigterm_exits_quietly(job, tmp_path):
    checkpoints = str(tmp_path / "ckpt")
    command = [sys.executable, os.path.join(job["out"], "run.py"), "--standalone", "--nproc-per-node", "2", "--",
               "--steps", str(STEPS), "--data", job["train"], "--checkpoint-dir", checkpoints, "--resume", "auto",
               "--timeout", str(PEER_TIMEOUT_S)]
    env = dict(os.environ, OMP_NUM_THREADS="1", JOB_SIGNAL_AT="1", JOB_RANK="1", JOB_SIGNAL="TERM",
               JOB_SIGNAL_TO="torchrun")
    result = subprocess.run(command, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env)
    assert result.returncode == 128 + 15, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "launcher stopped by SIGTERM" in result.stderr and "saved" in result.stdout, result.stdout
    saved = os.listdir(checkpoints)  # one save, at the step the ranks agreed on after torchrun forwarded the signal
    assert len(saved) == 1 and 2 <= int(saved[0].split("_")[1]) < STEPS, saved


def test_damaged_checkpoint_falls_back_and_full_disk_keeps_the_previous(job, tmp_path):
    checkpoints = tmp_path / "ckpt"
    common = ["--data", job["train"], "--seed", "3", "--checkpoint-dir", str(checkpoints), "--save-every", "1"]
    run_ok(job["out"], 2, "--steps", "2", *common)
    shard = sorted(n for n in os.listdir(checkpoints / "step_2") if n.endswith(".distcp"))[1]
    with open(checkpoints / "step_2" / shard, "r+b") as handle:
        handle.truncate(os.path.getsize(checkpoints / "step_2" / shard) // 2)
    resumed = torchrun(job["out"], 2, "--steps", "3", *common, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {checkpoints / 'step_2'} is damaged ({shard} has" in resumed.stderr, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_1 (step 1)" in resumed.stdout
    assert sorted(os.listdir(checkpoints)) == ["step_1", "step_2", "step_3"]  # step_2 rewritten by this run

    before = {name: os.path.getsize(checkpoints / "step_3" / name) for name in os.listdir(checkpoints / "step_3")}
    env = {"JOB_FSIZE_AT": "0", "JOB_RANK": "1", "JOB_FSIZE": "1024"}
    full = torchrun(job["out"], 2, "--steps", "5", *common, "--resume", "auto", env_extra=env)
    assert full.returncode != 0
    assert "checkpoint" in full.stderr and "step_4 could not be written: file too large" in full.stderr, full.stderr
    assert f"the previous checkpoint {checkpoints / 'step_3'} is intact" in full.stderr
    # the ranks print the message only (torchrun adds its own ChildFailedError traceback for any failed job)
    assert "CheckpointException" not in full.stderr and "OSError: [Errno 27]" in full.stderr, full.stderr[-3000:]
    assert sorted(os.listdir(checkpoints)) == ["step_1", "step_2", "step_3"]
    assert {name: os.path.getsize(checkpoints / "step_3" / name) for name in os.listdir(checkpoints / "step_3")} == before


def test_sharded_mixture_in_epoch_order_resumes_exactly_and_names_a_changed_shard(job, tmp_path):
    rng = np.random.default_rng(1)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, 300)
    os.makedirs(tmp_path / "web")
    os.makedirs(tmp_path / "code")
    for shard in range(3):  # llm.c's format, 37 windows of 8 tokens each
        with open(tmp_path / "web" / f"web_train_{shard:06d}.bin", "wb") as handle:
            handle.write(header.tobytes() + rng.integers(0, 48, 300).astype(np.uint16).tobytes())
    for shard in range(2):
        np.save(tmp_path / "code" / f"code_{shard}.npy", rng.integers(0, 48, 200).astype(np.int32))
    common = ["--data", f"0.7:{tmp_path}/web/*.bin,0.3:{tmp_path}/code/", "--data-order", "epoch", "--seed", "5"]
    checkpoints, metrics, whole = tmp_path / "ckpt", str(tmp_path / "m.jsonl"), str(tmp_path / "whole.pt")
    first = run_ok(job["out"], 2, "--steps", str(STEPS), *common, "--checkpoint-dir", str(checkpoints),
                   "--save-every", "3", "--save", whole, "--metrics", metrics)
    assert "data: 70% " in first.stdout and "every non-overlapping window once per pass" in first.stdout

    manifest = json.load(open(os.path.join(job["out"], "manifest.json")))
    model_file = load_model_file(MODEL)
    model = model_file.model()
    optimizer = model_file.module.optimizer(list(model.parameters()))
    source = TokenBatches(common[1], manifest, seed=5, order="epoch")
    for step in range(STEPS):
        (inputs,), _kwargs, target = source(step)
        model_file.module.loss_fn(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_state_close(torch.load(whole), model.state_dict())
    last = [json.loads(line) for line in open(metrics)][-1]
    assert last["tokens_seen"] == STEPS * 4 * 8 and set(last["data_pass"]) == {"web", "code"}
    assert last["data_pass"] == source.position(STEPS - 1)["data_pass"]

    for name in ("again", "changed"):
        shutil.copytree(checkpoints / "step_3", tmp_path / name / "step_3")
    resumed = str(tmp_path / "resumed.pt")
    run_ok(job["out"], 2, "--steps", str(STEPS), *common, "--resume", str(tmp_path / "again"), "--save", resumed)
    assert_state_close(torch.load(resumed), torch.load(whole), atol=0)

    changed = tmp_path / "web" / "web_train_000001.bin"
    with open(changed, "r+b") as handle:  # the same size, other tokens
        handle.seek(1024)
        handle.write(rng.integers(0, 48, 300).astype(np.uint16).tobytes())
    refused = torchrun(job["out"], 2, "--steps", str(STEPS), *common, "--resume", str(tmp_path / "changed"))
    assert refused.returncode != 0
    assert f"web: 1 shard(s) rewritten ({changed} (same tokens count, other contents))" in refused.stderr
    assert "pass --accept-data-change to train on the data as it is now from step 4 on" in refused.stderr
    accepted = run_ok(job["out"], 2, "--steps", str(STEPS), *common, "--resume", str(tmp_path / "changed"),
                      "--accept-data-change")
    assert "--accept-data-change: web: 1 shard(s) rewritten" in accepted.stdout
    assert "from step 4 every source of --data starts a new pass" in accepted.stdout and "step 4/6" in accepted.stdout
