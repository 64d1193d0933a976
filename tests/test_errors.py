"""Bad input ends in a clear message (on every rank) and a non-zero exit, fast: never a hang."""
import os
import re
import subprocess
import sys
import time

import pytest

from tracepp.cli import main as cli_main
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import model_path, torchrun


def run_cli(capsys, *argv):
    code = cli_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def write_model(tmp_path, body: str, name="m.py") -> str:
    path = tmp_path / name
    path.write_text("import torch\nimport torch.nn as nn\n" + body)
    return str(path)


MINIMAL = """
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
def example_inputs():
    return (torch.randn(4, 4),)
"""


def test_missing_model_file(tmp_path, capsys):
    code, text = run_cli(capsys, "split", str(tmp_path / "nope.py"), "-o", str(tmp_path / "out"))
    assert code == 2 and "not found" in text and "nope.py" in text


def test_missing_required_functions(tmp_path, capsys):
    path = write_model(tmp_path, "def model():\n    return nn.Linear(2, 2)\n")
    code, text = run_cli(capsys, "split", path, "-o", str(tmp_path / "out"))
    assert code == 2 and "example_inputs()" in text


def test_loss_without_target(tmp_path, capsys):
    path = write_model(tmp_path, MINIMAL + "def loss_fn(o, t):\n    return o.sum()\n")
    code, text = run_cli(capsys, "split", path, "-o", str(tmp_path / "out"))
    assert code == 2 and "example_target()" in text and "loss_fn" in text


def test_unknown_split_point_names_nearby(tmp_path, capsys):
    code, text = run_cli(capsys, "split", model_path("residual_mlp_lm"), "-o", str(tmp_path / "out"),
                         "--split-points", "layers.9")
    assert code == 2
    assert "split point 'layers.9' not found" in text and "layers.0" in text and "layers.3" in text


def test_split_points_out_of_order(tmp_path, capsys):
    code, text = run_cli(capsys, "split", model_path("residual_mlp_lm"), "-o", str(tmp_path / "out"),
                         "--ranks", "3", "--split-points", "layers.3,layers.1")
    assert code == 2 and "not in execution order" in text and "layers.1, layers.3" in text


def test_more_stages_than_graph_gives(tmp_path, capsys):
    path = write_model(tmp_path, MINIMAL)
    code, text = run_cli(capsys, "split", path, "-o", str(tmp_path / "out"), "--ranks", "8", "--microbatches", "2")
    assert code == 2 and "cannot make 8 stages" in text


def test_export_failure_names_the_line(tmp_path, capsys):
    code, text = run_cli(capsys, "split", model_path("data_dependent"), "-o", str(tmp_path / "out"),
                         "--microbatches", "2")
    assert code == 2
    assert "data_dependent.py:13" in text, text
    assert "torch.where" in text or "torch.cond" in text


@pytest.mark.timeout(120)
def test_world_size_mismatch_fails_every_rank(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("residual_mlp_lm"), out, num_microbatches=2, layout=Layout(pp=2))
    start = time.time()
    result = torchrun(out, 3, "--steps", "1", timeout=90)
    assert result.returncode != 0
    assert time.time() - start < 60
    # each rank checks before it joins the others; torchrun stops the ranks still starting once the first exits (on
    # a loaded machine a rank may not have got as far as its check), so every rank that says anything says this
    message = "error: this pipeline was planned for 2 ranks but torchrun started 3"
    said = re.findall(r"\[tracepp rank \d\] (.*)", result.stderr)
    assert said and all(line.startswith(message) for line in said), result.stderr[-3000:]


@pytest.mark.timeout(120)
def test_wrong_batch_shape_fails_every_rank(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("bad_shape_batch"), out, num_microbatches=2, layout=Layout(pp=2))
    result = torchrun(out, 2, "--steps", "2", timeout=90)
    assert result.returncode != 0
    message = "input args[0] has shape (4, 5) but the pipeline was traced with (2, 6)"
    for rank in range(2):  # each rank names the cause: found in its own batch, or told by the rank that found it
        # first (on a loaded machine one rank can get there before the other has read its batch)
        assert re.search(rf"\[tracepp rank {rank}\] (error|stopping because rank \d failed): batch for step 1: "
                         + re.escape(message), result.stderr), result.stderr[-3000:]
    assert f"error: batch for step 1: {message}" in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(120)
def test_crashed_rank_stops_the_others(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("crash_on_step"), out, num_microbatches=2, layout=Layout(pp=2))
    ckpt = tmp_path / "ckpt.pt"
    start = time.time()
    result = torchrun(out, 2, "--steps", "3", "--save", str(ckpt), timeout=90)
    elapsed = time.time() - start
    assert result.returncode != 0
    assert "[tracepp rank 1] error: RuntimeError: simulated failure inside loss_fn" in result.stderr
    assert "[tracepp rank 0] stopping because rank 1 failed: RuntimeError: simulated failure" in result.stderr
    assert elapsed < 40, f"took {elapsed:.1f}s to fail"
    assert not ckpt.exists() and not list(tmp_path.glob("ckpt.pt.tmp*"))


def test_data_dependent_size_across_a_boundary(tmp_path, capsys):
    code, text = run_cli(capsys, "split", model_path("data_dependent_size"), "-o", str(tmp_path / "out"),
                         "--microbatches", "1")
    assert code == 2 and "data-dependent size" in text and "move the split point" in text
