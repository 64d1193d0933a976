"""tracepp.costs.measure_in_run: in-run stage costs between a run's steps (plain data, and one torchrun run)."""
import json
import os
import subprocess
import sys

import pytest

from tracepp.costs.measure_in_run import PairedCosts, bracketed, read_paired
from util import model_path


def _rounds(stage, values):
    return [{"after_step": 4 + j, "costs": None if v is None else {f"{stage}F": v}} for j, v in enumerate(values)]


def test_read_paired_merges_ranks_and_drops_the_first_alternation(tmp_path):
    """Each rank writes its own stages' rounds; a round is the union of the ranks' (None if a stage is missing),
    and the first paired step with the round before it is dropped."""
    prefix = str(tmp_path / "p")
    (tmp_path / "p.rank0.json").write_text(json.dumps({"rounds": _rounds(0, [1.0, 2.0, 3.0, 4.0]), "error": None}))
    (tmp_path / "p.rank1.json").write_text(json.dumps({"rounds": _rounds(1, [5.0, 6.0, None, 8.0]),
                                                       "error": "RuntimeError: boom"}))
    found = read_paired(prefix, 2, 2, [0.1, 0.2, 0.3])
    assert found["step_times"] == [0.2, 0.3]
    assert found["rounds"] == [{"0F": 2.0, "1F": 6.0}, None, {"0F": 4.0, "1F": 8.0}]
    assert found["errors"] == ["rank 1: RuntimeError: boom"]
    assert bracketed(found) == []  # both steps border the missing round
    (tmp_path / "p.rank1.json").unlink()
    found = read_paired(prefix, 2, 2, [0.1, 0.2, 0.3])
    assert found["rounds"] == [None, None, None] and found["errors"] == ["rank 1 wrote no p.rank1.json"]


def test_bracketed_prices_each_step_with_the_rounds_around_it():
    paired = {"step_times": [2.0, 4.0, 8.0], "rounds": [{"0F": 1.0}, {"0F": 2.0}, None, {"0F": 1.0}]}
    assert bracketed(paired) == [({"0F": 1.5}, 2.0)]
    assert bracketed(None) == [] and bracketed({"step_times": [1.0], "rounds": [{"0F": 1.0}]}) == []


def test_paired_costs_survive_a_meter_that_cannot_be_built(tmp_path):
    """A rank whose meter fails still takes every round (and every barrier, in a run), writes the error and the
    rounds without costs, and the run goes on."""

    class FakePipeline:
        device, precision, stage_indices = "cpu", "fp32", [0]

    paired = PairedCosts(str(tmp_path / "missing"), first=3, count=2, prefix=str(tmp_path / "p"), rank=0)
    for step in range(6):
        paired.at_step(FakePipeline, step)
        paired.at_step_end(FakePipeline, step)
    found = json.loads((tmp_path / "p.rank0.json").read_text())
    assert [r["after_step"] for r in found["rounds"]] == [2, 3, 4] and all(r["costs"] is None for r in found["rounds"])
    assert "missing" in found["error"]


@pytest.mark.timeout(300)
def test_a_two_rank_run_measures_its_own_stages_between_steps(tmp_path):
    """Under torchrun: each rank times its own stage between the paired steps; the run's steps and losses are
    those of a run without it (the meter trains nothing)."""
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    out = str(tmp_path / "out")
    split_model(model_path("tied_lm"), out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

    def run(*extra, metrics):
        command = launch + [*extra, "--", "--steps", "6", "--metrics", str(metrics), "--quiet", "--timeout", "60"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return [json.loads(line) for line in open(metrics)]

    paired = run("-m", "tracepp.costs.measure_in_run", out, "--paired-from", "3", "--paired-steps", "3",
                 "--prefix", str(tmp_path / "p"), metrics=tmp_path / "paired.jsonl")
    plain = run(os.path.join(out, "run.py"), metrics=tmp_path / "plain.jsonl")
    assert [line["loss"] for line in paired] == pytest.approx([line["loss"] for line in plain], rel=1e-6)
    for rank, stage in ((0, 0), (1, 1)):
        found = json.loads((tmp_path / f"p.rank{rank}.json").read_text())
        assert found["error"] is None and found["stages"] == [stage]
        assert [r["after_step"] for r in found["rounds"]] == [2, 3, 4, 5]
        assert all(set(r["costs"]) == {f"{stage}{kind}" for kind in "FBIW"} for r in found["rounds"])
    merged = read_paired(str(tmp_path / "p"), 2, 2, [line["step_time_s"] for line in paired[3:]])
    assert len(merged["step_times"]) == 2 and len(bracketed(merged)) == 2
