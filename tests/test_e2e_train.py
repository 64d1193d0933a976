"""Tier 3: tracepp split + torchrun on gloo; trained parameters equal eager training within 2e-5."""
import os
import subprocess
import sys

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import (assert_state_close, assert_trained, eager_train, model_path, run_ok, torchrun)

STEPS = 3


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks,points", [(2, ["layers.2"]), (3, ["layers.1", "layers.3"])])
def test_residual_mlp_matches_eager(tmp_path, schedule, ranks, points):
    path = model_path("residual_mlp_lm")
    out = str(tmp_path / "out")
    split_model(path, out, schedule=schedule, num_microbatches=4, split_points=points, layout=Layout(pp=ranks))
    ckpt = str(tmp_path / "ckpt.pt")
    metrics = str(tmp_path / "metrics.jsonl")
    # pipeline messages: shared-memory rings by default on one host when each rank has a core (else gloo);
    # gloo's sockets asked for in one case, rings insisted on in another (a middle rank with two peers)
    p2p = {("1f1b", 2): "gloo", ("1f1b", 3): "shm"}.get((schedule, ranks), "auto")
    result = run_ok(out, ranks, "--steps", str(STEPS), "--save", ckpt, "--metrics", metrics, "--p2p", p2p)
    assert f"step {STEPS}/{STEPS}" in result.stdout
    saved = torch.load(ckpt)
    expected = eager_train(path, STEPS)
    assert_trained(saved, path)
    assert_state_close(saved, expected)
    # the checkpoint loads into the original model, strictly
    from tracepp.modelfile import load_model_file
    load_model_file(path).model().load_state_dict(saved)
    lines = open(metrics).read().splitlines()
    assert len(lines) == STEPS
    import json
    record = json.loads(lines[-1])
    assert {"step", "loss", "step_time_s"} <= set(record)
    assert isinstance(record["minor_faults"], int) and record["minor_faults"] >= 0  # the step's page faults
    # the reporting (last) rank ran on its own share of the cores, or unbound where ranks outnumber them
    from tracepp.runtime.cpu_binding import cores_for
    assert record.get("cpu_cores") == cores_for(ranks - 1, ranks, os.sched_getaffinity(0))
    from tracepp.runtime.shm_p2p import available
    rings = available() is None and (p2p == "shm" or p2p == "auto" and ranks <= len(os.sched_getaffinity(0)))
    assert record["p2p"] == ("shm" if rings else "gloo")


BLOCKER = """
import importlib.machinery
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tracepp", "tabulate"):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(module.__name__ + " is blocked for this test")


sys.meta_path.insert(0, _Block())
"""


def test_runs_without_tracepp_installed(tmp_path):
    """The output folder needs torch only: tracepp (and tabulate) made unimportable, a pipe_split model trains."""
    path = model_path("marker_mlp")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": str(blocker)}
    ckpt = str(tmp_path / "ckpt.pt")
    check = subprocess.run([sys.executable, "-c", "import tracepp"], env=dict(os.environ, **env),
                           capture_output=True, text=True)
    assert check.returncode != 0 and "blocked" in check.stderr
    result = torchrun(out, 2, "--steps", "2", "--save", ckpt, env_extra=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_state_close(torch.load(ckpt), eager_train(path, 2))


EXIT_CHECK = """
import atexit
import os
import sys


def _report():
    import torch.distributed as dist
    left = dist.is_available() and dist.is_initialized()
    sys.stderr.write(f"rank {os.environ['RANK']}: process group left at exit: {left}\\n")


if "RANK" in os.environ:  # the rank's process, not torchrun's own
    atexit.register(_report)
"""


def test_one_rank_torchrun_ends_its_process_group(tmp_path):
    """torchrun with one rank starts a process group too; run.py must destroy it (NCCL warns at exit that
    destroy_process_group() was not called, on every single-GPU run, when it is left)."""
    path = model_path("residual_mlp_lm")
    out = str(tmp_path / "out")
    split_model(path, out, num_stages=2, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(EXIT_CHECK)
    result = torchrun(out, 1, "--steps", "2", "--quiet", env_extra={"PYTHONPATH": str(hooks)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0: process group left at exit: False" in result.stderr, result.stderr[-3000:]


def test_single_process_two_stages_without_torchrun(tmp_path):
    """One rank holding both stages runs with plain `python run.py` (the single-GPU path), values passed locally."""
    path = model_path("residual_mlp_lm")
    out = str(tmp_path / "out")
    split_model(path, out, num_stages=2, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1))
    ckpt = str(tmp_path / "ckpt.pt")
    result = subprocess.run([sys.executable, os.path.join(out, "run.py"), "--steps", "3", "--save", ckpt],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_state_close(torch.load(ckpt), eager_train(path, 3))
