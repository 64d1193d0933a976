"""``tracepp plan --tune --measure K`` (tracepp/costs/measure_plans.py): the paired order, the table of measured
beside predicted, the pick (tier 1, plain data); and one small run of it end to end (tier 3: two plans of a tiny
model, one round, under torchrun). No time is asserted: which plan is fastest is whatever the measurement says,
and the test holds the command to its own measurement."""
from __future__ import annotations

import json
import os

import pytest
from pytest import approx

from tracepp.cli import main as cli_main
from tracepp.codegen.manifest import load_manifest
from tracepp.costs.measure_plans import MeasuredPlan, fastest, format_measured, interleavable, run_order, summarize
from tracepp.costs.search import Candidate
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import model_path


def _candidate(schedule: str, microbatches: int, step_s: float) -> Candidate:
    return Candidate(schedule=schedule, num_stages=2, num_microbatches=microbatches, split=(0, 1),
                     split_points=["layers.2"], split_source="balancer", step_s=step_s, stage_to_rank=[0, 1])


def _lines(*times):
    return [{"step_time_s": t, "cpu_time_s": t / 2} for t in times]


def test_the_order_flips_every_round():
    assert run_order(3, 3) == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    assert run_order(1, 2) == [[0], [0]]


def test_plans_share_one_job_only_when_they_can():
    def plan(k, processes=2, **fields):
        candidate = _candidate("1f1b", 4, 0.1)
        for name, value in fields.items():
            setattr(candidate, name, value)
        return MeasuredPlan(k, candidate, processes=processes)

    gib = 2 ** 30
    assert interleavable([plan(1), plan(2)], 8 * gib) is None
    assert interleavable([plan(1)], 8 * gib) == "one plan"
    assert "different process counts (2, 4)" in interleavable([plan(1), plan(2, processes=4)], 8 * gib)
    four_stages = dict(processes=4, stage_to_rank=[0, 1, 2, 3])
    assert "#2 is not pipeline parallel alone" in interleavable([plan(1, **four_stages), plan(2, tp=2, processes=4)],
                                                                 None)
    assert "#1 is not pipeline parallel alone" in interleavable([plan(1, processes=4), plan(2, **four_stages)],
                                                                 None)  # 4 processes on 2 pipeline ranks: dp 2
    assert "#2 is not pipeline parallel alone" in interleavable([plan(1), plan(2, ep=2)], None)
    big = {0: 3 * gib, 1: 2 * gib}  # the largest rank counts: 3 GiB a plan, 6 together
    assert "need 6.0 GiB together" in interleavable([plan(1, peak_memory=big), plan(2, peak_memory=big)], 8 * gib)
    assert interleavable([plan(1, peak_memory=big), plan(2, peak_memory=big)], 16 * gib) is None
    assert interleavable([plan(1, peak_memory=big), plan(2, peak_memory=big)], None) is None  # unknown: not checked


def test_measured_beside_predicted_ranks_and_the_pick():
    plans = [MeasuredPlan(1, _candidate("1f1b", 8, 0.100), rounds=[_lines(0.14, 0.12, 0.13), _lines(0.15, 0.11, 0.13)]),
             MeasuredPlan(2, _candidate("gpipe", 4, 0.110), rounds=[_lines(0.10, 0.11, 0.12), _lines(0.12)]),
             MeasuredPlan(3, _candidate("1f1b", 2, 0.120), error="round 1: exit 1: boom")]
    rows = summarize(plans)
    assert [row["predicted_rank"] for row in rows] == [1, 2, 3]
    assert rows[0]["measured_s"] == 0.13 and rows[1]["measured_s"] == approx(0.115)  # medians over all rounds' steps
    assert rows[0]["round_medians_s"] == [0.13, 0.13] and rows[1]["round_medians_s"] == [0.11, 0.12]
    assert [row["measured_rank"] for row in rows] == [2, 1, None]  # the failed plan is not ranked
    assert rows[0]["measured_over_predicted"] == approx(1.3) and rows[0]["over_best_measured"] == approx(0.13 / 0.115)
    assert rows[1]["cpu_s"] == approx(0.0575) and rows[2]["measured_s"] is None and rows[2]["error"].endswith("boom")
    assert fastest(plans) is plans[1]
    text = format_measured(rows)
    assert "measured/predicted" in text and "failed" in text and "115.0" in text
    assert fastest([plans[2]]) is None


@pytest.mark.parametrize("method", ["auto", "rounds"])
def test_measure_runs_the_best_plans_and_apply_takes_the_fastest_measured(tmp_path, capsys, method):
    out = str(tmp_path / "out")
    split_model(model_path("tied_lm_v"), out, schedule="1f1b", num_microbatches=2, split_points=["layers.2"],
                layout=Layout(pp=2))
    costs = tmp_path / "costs.json"  # made-up costs: the predicted order is known, the measured one is not
    costs.write_text(json.dumps({"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}))
    assert cli_main(["calibrate", out, "--costs", str(costs), "--no-comm", "--no-fit"]) == 0
    capsys.readouterr()
    assert cli_main(["plan", out, "--tune", "--measure", "2", "--measure-steps", "1", "--measure-rounds", "1",
                     "--measure-method", method, "--apply", "--schedules", "1f1b,gpipe",
                     "--microbatch-counts", "2,6"]) == 0
    text = capsys.readouterr().out
    assert "measured/predicted" in text, text
    with open(os.path.join(out, "tune_measured.json")) as handle:
        record = json.load(handle)
    rows = record["plans"]
    assert [row["predicted_rank"] for row in rows] == [1, 2]
    assert all(row["measured_s"] > 0 and row["measured_steps"] == 1 and row["error"] is None for row in rows), rows
    # auto: two pipeline-parallel plans of 2 processes share one job, their steps in turn
    assert {row["method"] for row in rows} == {"interleaved" if method == "auto" else "rounds"}, text
    best = min(rows, key=lambda row: row["measured_s"])
    assert f"applying #{best['predicted_rank']}: --schedule {best['plan']['schedule']}" in text, text
    plan = load_manifest(out)["plan"]
    assert (plan["schedule"], plan["num_microbatches"]) == (best["plan"]["schedule"], best["plan"]["num_microbatches"])
