"""Shared test helpers: split a model file, run it under torchrun (with a timeout), train eagerly to compare."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from tracepp.modelfile import load_model_file

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "models")
REPO = os.path.dirname(HERE)
TORCHRUN_TIMEOUT_S = 150  # a deadlock fails the test instead of eating CI's time
PEER_TIMEOUT_S = 45  # the runtime's own communication timeout inside the job


def model_path(name: str) -> str:
    return os.path.join(MODELS, name if name.endswith(".py") else name + ".py")


def torchrun(out_dir: str, nproc: int, *args: str, timeout: float = TORCHRUN_TIMEOUT_S, env_extra=None):
    """Run ``torchrun --standalone --nproc-per-node nproc out_dir/run.py args``; returns CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(out_dir, "run.py"), "--timeout", str(PEER_TIMEOUT_S), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def run_ok(out_dir: str, nproc: int, *args: str):
    result = torchrun(out_dir, nproc, *args)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def eager_train(path: str, steps: int, lr: float = 0.01) -> dict:
    """Train the unsplit model on the same batches the pipeline sees; return its state_dict."""
    model_file = load_model_file(path)
    module = model_file.module
    model = model_file.model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = module.optimizer(params) if hasattr(module, "optimizer") else torch.optim.SGD(params, lr=lr)
    for step in range(steps):
        if hasattr(module, "batch"):
            args, kwargs, target = module.batch(step)
        else:
            args, kwargs, target = model_file.example_inputs(), model_file.example_kwargs(), module.example_target()
        loss = module.loss_fn(model(*args, **kwargs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state_close(actual: dict, expected: dict, atol: float = 2e-5) -> None:
    assert sorted(actual) == sorted(expected), f"keys differ: {sorted(set(actual) ^ set(expected))}"
    worst = {k: (actual[k].float() - expected[k].float()).abs().max().item() for k in expected}
    bad = {k: v for k, v in worst.items() if v > atol}
    assert not bad, f"parameters differ from eager training beyond {atol}: {bad}"


def initial_state(path: str) -> dict:
    return {k: v.detach().clone() for k, v in load_model_file(path).model().state_dict().items()}


def assert_trained(actual: dict, path: str) -> None:
    """Guard against a vacuous comparison: training must have moved the parameters."""
    initial = initial_state(path)
    moved = max((actual[k].float() - initial[k].float()).abs().max().item() for k in initial)
    assert moved > 1e-4, "parameters did not change: the comparison would prove nothing"
