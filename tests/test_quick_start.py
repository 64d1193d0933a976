"""The README's quick start, as a newcomer meets it.

* A rank whose Python lacks numpy (torch.distributed needs it to exchange objects between ranks) says so and how
  to fix it, and exits non-zero within seconds: no traceback (it used to die in ``all_gather_object`` with
  torch's bare "Numpy is not available"). tracepp declares numpy, so an install from the README has it; .ci/run
  proves that by running the README's main job in a new virtual environment.
* The main job's command, as the README writes it (less its installs), trains the example GPT and its loss falls
  clearly within the steps it runs.
"""
import importlib.metadata
import os
import re
import subprocess
import sys
import time

import pytest

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import PEER_TIMEOUT_S, REPO, model_path, torchrun

sys.path.insert(0, os.path.join(REPO, ".ci"))
from readme_block import block  # noqa: E402


def test_numpy_is_a_declared_dependency():
    requirements = importlib.metadata.requires("tracepp") or []
    names = {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in requirements
             if "extra ==" not in requirement}
    assert "numpy" in names, f"tracepp's install requirements {sorted(names)} lack numpy"


@pytest.mark.timeout(200)
def test_a_rank_without_numpy_names_it_and_the_fix(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("tied_lm"), out, num_microbatches=2, layout=Layout(pp=2))
    blocker = tmp_path / "no_numpy" / "numpy"  # first on the path: `import numpy` fails, as without numpy
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'numpy\' (hidden by the test)")\n')
    path = os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))
    started = time.monotonic()
    result = torchrun(out, 2, "--steps", "2", env_extra={"PYTHONPATH": path})
    seconds = time.monotonic() - started
    assert result.returncode != 0
    assert "numpy cannot be imported" in result.stderr and "-m pip install numpy" in result.stderr, result.stderr
    # torchrun prints its own ChildFailedError traceback for any rank that exits non-zero; the ranks print none
    assert "Numpy is not available" not in result.stderr and "tracepp_runtime" not in result.stderr, result.stderr
    assert seconds < PEER_TIMEOUT_S, f"took {seconds:.0f} s: it waited for a timeout instead of stopping"


@pytest.mark.timeout(300)
def test_the_readme_main_job_trains_and_its_loss_falls(tmp_path):
    with open(os.path.join(REPO, "README.md")) as handle:
        command = block("main job", handle.read())
    parts = [part.strip() for part in command.split("&&")]
    installs = [part for part in parts if part.startswith("python -m pip install")]
    assert installs and parts[:len(installs)] == installs, f"the installs come first: {command}"
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")  # the command's paths, from a copy's root
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(" && ".join(parts[len(installs):]), shell=True, cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the split planned the run run.py makes (its optimizer): no note that the memory figures are for another
    assert "for other run options" not in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(value) for value in re.findall(r"^step \d+/\d+ \| loss ([0-9.]+)", result.stdout, re.M)]
    assert len(losses) >= 10, result.stdout[-3000:]
    first, last_five = losses[0], sum(losses[-5:]) / 5
    assert first > 5.0 and last_five < first - 1.5, f"the loss went {first:.3f} -> {last_five:.3f} (mean of the " \
                                                    f"last 5 steps): a newcomer would not see it learn"
