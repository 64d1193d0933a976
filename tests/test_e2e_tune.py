"""Tier 3: `tracepp calibrate` (ping-pong and a short calibration run under torchrun), then `tracepp plan --tune
--apply` rewrites the folder with the chosen plan, which still trains (2 ranks, equal to eager training).
No time is asserted: the costs are made up, so the choice is known; the measured parts only have to be there."""
from __future__ import annotations

import json
import os

import torch

from tracepp.costs.model import load_calibration
from tracepp.cli import main as cli_main
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.codegen.manifest import load_manifest
from util import assert_state_close, eager_train, model_path, run_ok

MODEL = "tied_lm_v"  # 4 layers, tied embedding and head, batch 12


def test_calibrate_tune_apply_and_train(tmp_path, capsys):
    out = str(tmp_path / "out")
    split_model(model_path(MODEL), out, schedule="1f1b", num_microbatches=2, split_points=["layers.2"], layout=Layout(pp=2))
    # made-up stage costs at two microbatch sizes: a large fixed part per microbatch, so few microbatches win
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0, "microbatch_size": 6}))
    costs_small = tmp_path / "costs_small.json"
    costs_small.write_text(json.dumps({"0F": 0.9, "0B": 1.8, "1F": 0.9, "1B": 1.8, "microbatch_size": 2}))
    assert cli_main(["calibrate", out, "--costs", str(costs), "--costs", str(costs_small), "--fit-steps", "7"]) == 0
    calibration = load_calibration(out)
    assert "0-1" in calibration.comm["pairs"] and calibration.comm["pairs"]["0-1"]["latency_s"] >= 0
    assert calibration.overhead["measured_step_s"] > 0 and len(calibration.compute) == 2
    assert calibration.noise["run"] is not None and calibration.noise["run"] >= 0  # 4 steps after the warm-up
    assert "machine noise: calibration run steps" in capsys.readouterr().out
    assert cli_main(["plan", out]) == 0
    assert "the machine's noise while calibrating" in capsys.readouterr().out
    # the search: 1F1B or interleaved 1F1B, 2 to 6 microbatches; --apply splits again with the first row
    assert cli_main(["plan", out, "--tune", "--apply", "--schedules", "1f1b,interleaved-1f1b",
                     "--microbatch-counts", "2,3,4,6", "--top", "3"]) == 0
    text = capsys.readouterr().out
    first = next(line.split() for line in text.splitlines() if line.startswith("1 "))
    schedule, stages, microbatches = first[1], int(first[2]), int(first[4])
    assert f"applying #1: --schedule {schedule} --stages {stages} --microbatches {microbatches}" in text, text
    manifest = load_manifest(out)
    assert (manifest["plan"]["schedule"], len(manifest["stages"]), manifest["plan"]["num_microbatches"]) == (
        schedule, stages, microbatches)
    assert os.path.isfile(os.path.join(out, "calibration.json"))  # not a file the split writes: kept
    # a memory limit below every candidate: nothing fits, exit 2 naming the limit
    assert cli_main(["plan", out, "--tune", "--memory-limit", "1KB"]) == 2
    assert "--memory-limit 1KB" in capsys.readouterr().err


def test_apply_rewrites_the_folder_with_another_plan(tmp_path, capsys):
    out = str(tmp_path / "out")
    split_model(model_path(MODEL), out, schedule="1f1b", num_microbatches=2, split_points=["layers.2"], layout=Layout(pp=2))
    # no fixed part (one microbatch size: proportional), free comms: interleaving over 4 stages with 6 microbatches
    # has the smallest bubble of this grid
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}))
    assert cli_main(["calibrate", out, "--costs", str(costs), "--no-comm", "--no-fit"]) == 0
    assert cli_main(["plan", out, "--tune", "--apply", "--schedules", "1f1b,interleaved-1f1b",
                     "--microbatch-counts", "2,6"]) == 0
    text = capsys.readouterr().out
    manifest = load_manifest(out)
    plan = manifest["plan"]
    assert (plan["schedule"], plan["num_stages"], plan["num_microbatches"]) == ("interleaved-1f1b", 4, 6), text
    assert plan["stage_to_rank"] == [0, 1, 0, 1]
    # the hint runs from where the command ran, as split's does (it said `run.py`, true only inside the folder)
    assert f"run it: torchrun --nproc-per-node 2 {os.path.join(out, 'run.py')} --steps 3" in text, text
    # the balancer's cuts: the head (24 x 12) weighs two layers (12 x 12), so it gets a stage with the norm
    assert manifest["split_options"]["split_points"] == ["layers.1", "layers.2", "norm"]
    # the rewritten folder trains, equal to eager training
    saved = str(tmp_path / "trained.pt")
    run_ok(out, 2, "--steps", "2", "--save", saved)
    assert_state_close(torch.load(saved), eager_train(model_path(MODEL), 2))
    # and the calibration of the old split still prices the new one (by segment)
    capsys.readouterr()
    assert cli_main(["plan", out]) == 0
    assert "calibrated prediction (" in capsys.readouterr().out


def test_tune_chooses_tensor_parallelism_under_a_memory_limit_and_the_result_trains(tmp_path, capsys):
    # made-up stage costs, free comms: tp 2 halves the sharded compute but doubles the processes, so without a
    # limit tp 1 costs fewer GPU-seconds; a limit tp 1 cannot meet leaves tp 2, which --apply splits and runs
    path = model_path("tp_llama")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=2, split_points=["layers.2"], layout=Layout(pp=2))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}))
    assert cli_main(["calibrate", out, "--costs", str(costs), "--no-comm", "--no-fit"]) == 0
    search = ["plan", out, "--tune", "--schedules", "1f1b", "--microbatch-counts", "2", "--tp-sizes", "1,2",
              "--optimizer-bytes-per-param", "8", "--top", "8"]
    assert cli_main(search) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit() and "1f1b" in line]
    by_tp = {}
    for row in rows:  # #, schedule, stages, (k/rank), M, tp, split points..., step ms, bubble, peak MB...
        by_tp.setdefault(int(row[5]), []).append(row)
    assert rows[0][5] == "1" and set(by_tp) == {1, 2}
    step = {tp: min(float(r[-5]) for r in found) for tp, found in by_tp.items()}
    assert step[2] < step[1]  # the sharded layers' compute divided by 2
    peak = {tp: min(max(float(r[-3]), float(r[-1])) for r in found) for tp, found in by_tp.items()}
    assert peak[2] < peak[1]
    limit = f"{(peak[1] + peak[2]) / 2 / 1e3:.6f}GB"  # MB printed -> a limit between the two
    assert cli_main(search + ["--memory-limit", limit, "--apply"]) == 0
    text = capsys.readouterr().out
    assert "--tp 2" in text, text
    manifest = load_manifest(out)
    assert manifest["plan"]["mesh"]["tp"] == 2 and manifest["tp"]["params"]["head.weight"]["dim"] == 0
    saved = str(tmp_path / "trained.pt")
    run_ok(out, 4, "--steps", "2", "--save", saved)
    from test_e2e_dp import _eager_adamw
    assert_state_close(torch.load(saved), _eager_adamw(path, 2, 1e9)[0])
