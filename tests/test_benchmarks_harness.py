"""The benchmark harness end to end on one tiny case (harness correctness only: no time is ever asserted)."""
import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_case_noise_is_the_wider_of_the_measured_and_the_ideal_rounds():
    from benchmarks.predict import case_noise

    entry = {"tracepp": {"round_step_s": [0.10, 0.11, 0.12]}, "ideal": {"round_step_s": [0.09, 0.10, 0.095]}}
    assert case_noise(entry) == pytest.approx(0.02 / 0.11)
    entry["ideal"]["round_step_s"] = [0.08, 0.10, 0.12]
    assert case_noise(entry) == pytest.approx(0.4)
    assert case_noise({"tracepp": {"round_step_s": [0.1]}, "ideal": {}}) is None


def test_runtime_factors_divide_measurements_of_the_same_rounds():
    """The executor's costs are divided by the plain costs of stage_times' own alternating rounds, not by the
    per-round costs that replaced ``ideal.costs`` (measured minutes earlier, on another spell of the machine)."""
    from benchmarks.predict import runtime_section

    ideal = {"costs": {"0,F": 1.0, "0,B": 2.0}, "costs_stage_times": {"0,F": 2.0, "0,B": 4.0},
             "executor_costs": {"0,F": 2.2, "0,B": 4.0}}
    assert runtime_section({"ideal": ideal})["factors"] == pytest.approx({"F": 1.1, "B": 1.0})
    del ideal["costs_stage_times"]  # a suite without per-round costs: the ideal's costs are stage_times' own
    assert runtime_section({"ideal": ideal})["factors"] == pytest.approx({"F": 2.2, "B": 2.0})
    assert runtime_section({"ideal": {"costs": ideal["costs"]}}) == {}


def test_tiny_suite_writes_every_system_and_field(tmp_path):
    out = str(tmp_path / "results")
    command = [sys.executable, "-m", "benchmarks.run", "--tiny", "--rounds", "1", "--warmup", "1", "--steps", "10",
               "--out", out, "--tune"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the table printed, with its headers and the case's row
    for header in ("tracepp ms", "predicted ms", "error %", "noise %", "step error %", "torch ms", "eager ms", "ideal ms",
                   "tracepp/torch", "ideal/torch", "ideal/tracepp", "step ideal/tracepp", "mem tracepp MB"):
        assert header in result.stdout
    assert "1f1b" in result.stdout and "problems:" not in result.stdout, result.stdout
    files = glob.glob(os.path.join(out, "*_cpu.json"))
    assert len(files) == 1, os.listdir(out)
    report = json.load(open(files[0]))
    assert report["device"] == "cpu" and "CPU allocator" in report["memory_method"]
    assert "CPU allocator" in result.stdout  # the table's footnote states the method
    (entry,) = report["results"]
    for system in ("tracepp", "torch", "eager"):
        part = entry[system]
        assert part["status"] == "ok", part
        assert part["measured_steps"] >= 10
        assert part["step_time_s"] > 0 and part["tokens_per_s"] > 0
        assert len(part["peak_mem_mb_per_rank"]) == (1 if system == "eager" else 2)
        assert all(m > 0 for m in part["peak_mem_mb_per_rank"])  # a training step allocates activations
        assert len(part["rss_growth_mb_per_rank"]) == len(part["peak_mem_mb_per_rank"])
    assert entry["tracepp"]["minor_faults_per_step"] >= 0  # from run.py's --metrics
    # the in-run stage costs: 2 paired steps (after the first, dropped), each between two rounds of every stage
    (paired,) = entry["paired_runs"]
    assert paired["errors"] == [] and len(paired["step_times"]) == 2 and len(paired["rounds"]) == 3
    assert all(set(costs) == {f"{s}{k}" for s in (0, 1) for k in "FBIW"} for costs in paired["rounds"])
    assert len(entry["ideal"]["stepwise"]) == 2 and isinstance(entry["efficiency_stepwise"], float)
    assert entry["ideal_over_torch"] == entry["ideal"]["step_time_s"] / entry["torch"]["step_time_s"]
    # the calibrated simulator's prediction next to the measured step (one case: its overhead is its own fit)
    prediction = entry["prediction"]
    assert prediction["status"] == "ok" and prediction["step_time_s"] > 0 and prediction["fitted"] is True
    assert prediction["measured_step_s"] == entry["tracepp"]["step_time_s"]
    assert prediction["noise"] is None  # one round: no spread to report
    assert len(prediction["stepwise_errors"]) == 2 and isinstance(prediction["error_stepwise"], float)
    assert "0-1" in report["comm"]["pairs"] and len(report["loadavg_start"]) == 3
    # the tuner's benchmark: its pick split, run and measured next to the best hand-picked case
    tuned = report["tuner"]
    assert tuned["status"] == "ok" and tuned["tuned_step_s"] > 0 and tuned["hand_step_s"] > 0, tuned
    assert "tuner: picked" in result.stdout
    ideal = entry["ideal"]
    assert ideal["status"] == "ok" and ideal["step_time_s"] > 0
    assert {"0,F", "0,B", "1,F", "1,B", "0,I", "0,W"} <= set(ideal["costs"])
    # priced with the plain-autograd costs measured inside the round's tracepp run, paired with that round
    assert ideal["costs_method"].startswith("plain autograd") and len(ideal["round_step_s"]) == 1
    assert ideal["round_step_s"][0] == ideal["step_time_s"] and isinstance(entry["efficiency_paired"], float)
    for key in ("ratio_tracepp_over_torch", "efficiency", "speedup_over_eager"):
        assert isinstance(entry[key], float) and entry[key] > 0
    assert entry["same_losses"] is True  # same model, split, schedule, loss and SGD in both frontends
    assert entry["split_points"] == ["blocks.1"]
    # the floor loop (on with --tiny): tracepp's plan without its runtime, trained to the same losses, its own
    # paired steps priced with its own ranks' stage costs
    floor = entry["floor"]
    assert floor["status"] == "ok" and floor["measured_steps"] >= 10 and entry["floor_same_losses"] is True
    assert len(floor["stepwise"]) == 2 and isinstance(entry["floor_efficiency_stepwise"], float)
    assert entry["tracepp_over_floor"] == entry["tracepp"]["round_step_s"][0] / floor["round_step_s"][0]
    assert "tracepp/floor (rounds)" in result.stdout
    # the chart: written when matplotlib is there, else skipped with a note
    try:
        import matplotlib  # noqa: F401
        assert os.path.exists(files[0][:-len(".json")] + ".png")
    except ImportError:
        assert "chart skipped" in result.stdout


def test_cpu_allocator_peak_on_known_sizes():
    """The CPU memory measure on cases whose answer is known: a 10 MB temporary; 20 MB replaced each step."""
    import torch

    from benchmarks.memory import PeakMemory, peak_growth_bytes

    mb = 2**20

    def measure(step_fn, steps=4):
        memory, state = PeakMemory("cpu"), {}
        for step in range(steps):
            memory.at_step(step, steps)
            step_fn(state)
        return memory.stop()

    result = measure(lambda state: torch.empty(10 * mb, dtype=torch.uint8).fill_(1))
    assert result["peak_mb"] == 10.0 and "CPU allocator" in result["method"]

    def replace(state):  # the new 20 MB is allocated before the previous step's 20 MB is freed
        new = torch.ones(20 * mb, dtype=torch.uint8)
        state.pop("x", None)
        state["x"] = new

    result = measure(replace)
    assert result["peak_mb"] == 20.0 and result["profiled_live_mb_at_start"] == 20.0
    # the running sum: only events from the window's start count, relative to the sum there
    assert peak_growth_bytes([(1, 5), (2, 7), (3, -7), (4, 10), (5, -8)], start_ns=3) == (3, 12)
    assert peak_growth_bytes([(1, 5), (2, 7), (3, -7), (4, 3)], start_ns=3) == (0, 12)
    assert peak_growth_bytes([(1, 4), (2, -4)]) == (4, 0)


def test_cuda_without_a_gpu_fails_clearly(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run([sys.executable, "-m", "benchmarks.run", "--device", "cuda", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "CUDA is not available" in result.stderr
    assert not os.listdir(tmp_path)


def test_ideal_from_round_costs_pairs_rounds_and_skips_a_failed_one(tmp_path, monkeypatch):
    """The ideal is the median of the rounds' simulated steps, each round priced with the costs measured right
    after its runs; a round whose measurement failed is skipped, not paired with another round's step."""
    import benchmarks.stage_times as stage_times
    from benchmarks.run import _ideal_from_round_costs

    (tmp_path / "manifest.json").write_text("{}")
    # a stand-in simulator: the step is the sum of the costs (the real one is tested in test_calibration.py)
    monkeypatch.setattr(stage_times, "ideal_step", lambda manifest, costs, optimizer: {"ideal_step_s": sum(costs.values())})
    entry = {"ideal": {"step_time_s": 9.0, "costs": {"0,F": 9.0}}, "optimizer_stage_s": {}, "tokens_per_step": 100,
             "tracepp": {"round_step_s": [2.0, 4.0, 5.0]},
             "round_costs": [{"0F": 1.0, "0B": 0.6}, None, {"0F": 2.0, "0B": 2.0}]}
    _ideal_from_round_costs(str(tmp_path), entry, {"costs": {"0,F": 9.0}})
    ideal = entry["ideal"]
    assert ideal["round_step_s"] == [1.6, None, 4.0] and ideal["step_time_s"] == 2.8  # median of 1.6 and 4.0
    assert ideal["step_time_s_stage_times"] == 9.0 and ideal["costs_stage_times"] == {"0,F": 9.0}
    assert entry["compute_costs"] == {"0F": 1.5, "0B": 1.3} and ideal["costs"] == {"0,F": 1.5, "0,B": 1.3}
    assert entry["efficiency_paired"] == (1.6 / 2.0 + 4.0 / 5.0) / 2  # rounds 0 and 2, each with its own run
    assert "round_costs" not in entry and entry["costs_source"].startswith("plain autograd")
    assert "efficiency_stepwise" not in entry  # no paired steps
    # paired steps: each priced with the mean of the rounds right before and after it; a missing round skips it
    entry = {"ideal": {"step_time_s": 9.0, "costs": {"0,F": 9.0}}, "optimizer_stage_s": {}, "tokens_per_step": 100,
             "tracepp": {"round_step_s": [2.0]}, "round_costs": [{"0F": 1.0, "0B": 1.0}],
             "paired_runs": [{"step_times": [2.0, 4.0, 8.0], "rounds": [{"0F": 1.0, "0B": 1.0},
                                                                        {"0F": 2.0, "0B": 1.0}, None, {"0F": 1.0}]},
                             None]}
    _ideal_from_round_costs(str(tmp_path), entry, {"costs": {"0,F": 9.0}})
    assert entry["ideal"]["stepwise"] == [[2.5, 2.0]]  # step 1 and 2 border the missing round
    assert entry["efficiency_stepwise"] == 1.25
    # every measurement failed: the executor's per-action times, said so
    entry = {"ideal": {"step_time_s": 9.0, "costs": {"0,F": 9.0}}, "optimizer_stage_s": {}, "tokens_per_step": 100,
             "tracepp": {}, "round_costs": [None]}
    _ideal_from_round_costs(str(tmp_path), entry, {"costs": {"0,F": 9.0}})
    assert entry["ideal"]["step_time_s"] == 9.0 and "stage_times" in entry["costs_source"]
    assert entry["ideal"]["costs_method"].endswith("no paired steps")
    entry = {"ideal": {"step_time_s": 9.0, "costs": {"0,F": 9.0}}, "optimizer_stage_s": {}, "tokens_per_step": 100,
             "tracepp": {}, "round_costs": [None],
             "paired_runs": [{"step_times": [1.0], "rounds": [None, None], "errors": ["rank 1: OSError: x"]}]}
    _ideal_from_round_costs(str(tmp_path), entry, {"costs": {"0,F": 9.0}})
    assert entry["ideal"]["costs_method"].endswith("the in-run measurement failed: rank 1: OSError: x")


def test_each_round_is_priced_with_its_own_runs_in_run_costs(tmp_path, monkeypatch):
    """The ideal's stage costs of a round are the ones its tracepp run's ranks measured between its paired steps
    (their per-key median), not a measurement minutes away; torch and eager runs get no paired steps."""
    import benchmarks.run as run
    import tracepp.driver

    calls = []
    monkeypatch.setattr(run, "_comm", lambda *args: {})
    monkeypatch.setattr(run, "write_model_file", lambda path, config, stages: path)
    monkeypatch.setattr(tracepp.driver, "split_model", lambda *args, **kwargs: None)
    monkeypatch.setattr(run, "_run", lambda cmd, log, env, timeout: (False, "not run in this test", 0.0))

    def fake_system(system, case, model_path, out_dir, work, round_index, settings, device, threads, *rest, **kw):
        calls.append(f"{system}{round_index}")
        result = {"ok": True, "step_times": [1.0], "cpu_times": [], "losses": [], "memory": {}, "error": None}
        if system == "tracepp":
            result["paired"] = {"step_times": [1.0, 1.0], "errors": [],
                                "rounds": [{"0F": 1.0 + round_index, "0B": 2.0}, None, {"0F": 3.0 + round_index,
                                                                                       "0B": 2.0}]}
        return result

    monkeypatch.setattr(run, "run_system", fake_system)
    case = run.cpu_cases(True)[0]
    monkeypatch.setattr(run, "_merge", lambda runs, tokens: {"status": "failed", "error": "not merged in this test"})
    report = run.run_suite([case], run.Settings(rounds=2, warmup=0, measured=1, timeout=5.0, paired=2), "cpu", 1,
                           str(tmp_path), log=lambda text: None)
    assert calls == ["tracepp0", "torch0", "eager0", "torch1", "tracepp1", "eager1"]
    entry = report["results"][0]
    assert entry["round_costs"] == [{"0F": 2.0, "0B": 2.0}, {"0F": 3.0, "0B": 2.0}]  # medians, the None skipped
    assert len(entry["paired_runs"]) == 2
    assert run._median_costs([None, {"0F": 1.0}]) == {"0F": 1.0} and run._median_costs([None, None]) is None


def test_a_case_with_paired_steps_is_fitted_to_them(monkeypatch):
    """The overhead fitted to a case with paired steps is the median of one fit per paired step (each step with
    the costs measured around it), not the fit of the median step to the rounds' costs; the other case is
    predicted with it (leave one out) and its paired steps get their own errors."""
    import tracepp.codegen.manifest
    from benchmarks.predict import predict_cases
    from test_calibration import _manifest

    monkeypatch.setattr(tracepp.codegen.manifest, "load_manifest", lambda out_dir: _manifest())
    costs = {"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}  # 15.0 per step without overheads (1F1B, M = 4)
    fast = {"case": "a", "out_dir": "a", "compute_costs": costs, "optimizer_stage_s": {},
            "tracepp": {"status": "ok", "step_time_s": 30.0},  # the measured steps: another spell of the machine
            "paired_runs": [{"step_times": [20.0, 20.0], "rounds": [costs, costs, costs]}]}
    other = {"case": "b", "out_dir": "b", "compute_costs": costs, "optimizer_stage_s": {},
             "tracepp": {"status": "ok", "step_time_s": 20.0},
             "paired_runs": [{"step_times": [18.0, 22.0], "rounds": [costs, costs, costs]}]}
    predict_cases([fast, other], {}, log=lambda text: None, mode="scale")
    assert fast["prediction"]["fitted_overhead_s"] == pytest.approx(1 / 3, rel=1e-3)  # 15.0 * 4 / 3 = 20.0
    assert fast["prediction"]["fitted_per_step"] == 2
    assert other["prediction"]["overhead_s"] == pytest.approx(1 / 3, rel=1e-3)  # a's fit, not b's own
    assert other["prediction"]["step_time_s"] == pytest.approx(20.0, rel=1e-3)
    assert other["prediction"]["stepwise_errors"] == pytest.approx([20 / 18 - 1, 20 / 22 - 1], rel=1e-3)


def test_action_costs_compares_each_kind_with_its_plain_cost_without_waits():
    """benchmarks.studies.action_costs' summary: per (stage, kind) the median action time less its wait for received data,
    against the median plain cost of the rounds (the first round dropped), and the step split into its parts."""
    from benchmarks.studies.action_costs import summarize

    actions, steps = [], {}
    for step in range(4):
        clock = 100.0 * step
        steps[str(step)] = [clock, clock + 0.020]
        clock += 0.001  # before the first action
        for label, seconds, waited in (("1RECV_F0<0", 0.0005, 0.0), ("1F0", 0.004, 0.001), ("1I0", 0.006, 0.0),
                                       ("1SEND_B0>0 1RECV_F1<0", 0.0005, 0.0), ("1W0", 0.003, 0.0)):
            actions.append((step, label, seconds, waited, clock))
            clock += seconds + 0.0001  # between actions
    rounds = [{"costs": {"1F": 9.0}}, {"costs": {"1F": 0.002, "1I": 0.005, "1W": 0.003}},
              {"costs": {"1F": 0.004, "1I": 0.005, "1W": 0.003}}, {"costs": None}]
    result = summarize(actions, rounds, first=1, count=2, steps=steps)
    f, i, w = (result["kinds"][k] for k in ("1F", "1I", "1W"))
    assert f["run_s"] == pytest.approx(0.003) and f["wait_s"] == pytest.approx(0.001)  # the wait is not F's cost
    assert f["plain_s"] == pytest.approx(0.003) and f["ratio"] == pytest.approx(1.0)  # 9.0 was the dropped round
    assert i["ratio"] == pytest.approx(1.2) and w["ratio"] == pytest.approx(1.0) and f["per_step"] == 1
    assert set(result["kinds"]) == {"1F", "1I", "1W"}  # comm actions are not compute
    assert result["run_s"] == pytest.approx(0.012) and result["plain_s"] == pytest.approx(0.011)
    assert result["step_s"] == pytest.approx(0.020) and result["head_s"] == pytest.approx(0.001)
    assert result["comm_s"] == pytest.approx(0.001) and result["gaps_s"] == pytest.approx(0.0004)
    assert result["tail_s"] == pytest.approx(0.020 - 0.001 - 0.014 - 0.0004)


def test_floor_table_pools_the_paired_steps_of_every_suite_file():
    """peer_tables' floor table: each case's paired steps from every file, medians and quartiles of ideal / step."""
    from benchmarks.peer_tables import floor_table

    def suite(scale):
        entry = {"schedule": "gpipe", "microbatches": 4, "model": {"name": "d128_l8_b32_s32"},
                 "ideal": {"stepwise": [[0.9 * scale, 1.0], [0.8 * scale, 1.0]]},
                 "floor": {"stepwise": [[0.95, 1.0], [0.97, 1.0]], "round_step_s": [2.0]},
                 "tracepp": {"round_step_s": [2.2]}, "floor_same_losses": True}
        no_floor = dict(entry, floor={}, schedule="1f1b")  # a suite run without --floor: not a row
        return {"results": [entry, no_floor]}

    text = floor_table([suite(1.0), suite(1.1)])
    rows = [line for line in text.splitlines() if line.startswith("| gpipe")]
    assert len(rows) == 1 and "1f1b" not in text
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # ideal / tracepp over 4 steps: 0.8, 0.88, 0.9, 0.99 -> median 0.89, quartiles at positions 1 and 3
    assert cells[1] == "4 / 4" and cells[2] == "0.890 [0.880 - 0.990]"
    assert cells[3] == "0.960 [0.950 - 0.970]" and cells[4] == "100%"
    assert cells[5] == "1.100 [1.100 - 1.100]" and cells[6] == "yes"


def test_megatron_bytes_compare_names_each_changed_plan_and_ignores_a_library_path(tmp_path):
    # the before/after check of a planner change: a model whose layer bytes or shares moved is named with the layer,
    # one unchanged is counted, an error differing only in where the library is installed is no change
    from benchmarks.studies.megatron_bytes import compare

    def write(name, records):
        path = tmp_path / name
        path.write_text(json.dumps({"records": records}))
        return str(path)

    before = write("before.json", [
        {"model": "zamba", "layers": {"model.layers.1": [40960, 32768]}, "share": [0.43, 0.43], "worst": 1.25},
        {"model": "llama", "layers": {"model.layers.0": [32768, 32768]}, "share": [0.99, 0.99], "worst": 1.0},
        {"model": "blt", "error": "TraceError: at /a/venv/lib/python3.11/site-packages/transformers/x.py:9"},
        {"model": "gone", "layers": {}, "share": [1.0, 1.0], "worst": None}])
    after = write("after.json", [
        {"model": "zamba", "layers": {"model.layers.1": [131072, 32768]}, "share": [0.8, 0.8], "worst": 4.0},
        {"model": "llama", "layers": {"model.layers.0": [32768, 32768]}, "share": [0.99, 0.99], "worst": 1.0},
        {"model": "blt", "error": "TraceError: at /b/env/lib/python3.11/site-packages/transformers/x.py:9"},
        {"model": "new", "layers": {}, "share": [1.0, 1.0], "worst": None}])
    lines = compare(before, [after])
    assert lines[0] == ("zamba: shares [0.43, 0.43] -> [0.8, 0.8]; worst 1.25 -> 4.0\n"
                        "  model.layers.1: [40960, 32768] -> [131072, 32768]")
    assert lines[-1] == "2 of 3 models planned in both unchanged; 1 changed; 1 new, 1 not planned again"
    assert len(lines) == 2


def test_a_table_written_after_a_run_of_a_few_keeps_the_other_rows_from_the_newest_results(tmp_path):
    """The families tables are written from the study's cache. A cache is lost with its machine; a table written
    after a run of one family had kept that family's row alone and erased 195 (docs/families.md, 2026-12-01). A row
    the cache lacks now comes from the newest results JSON that holds it with steps run, and the table says so."""
    from benchmarks.studies.families import carried_text, table_records

    results, cache = tmp_path / "results", tmp_path / "cache"
    results.mkdir()
    cache.mkdir()
    old = {"families": [{"family": "a", "steps": {"pp": {"max_diff": 1.0}}},
                        {"family": "b", "steps": {"pp": {"max_diff": 2.0}}},
                        {"family": "c", "steps": {}}]}
    (results / "20261130-000000_families.json").write_text(json.dumps(old))
    newer = {"families": [{"family": "a", "steps": {}}, {"family": "b", "steps": {"pp": {"max_diff": 3.0}}}]}
    (results / "20261201-000000_families.json").write_text(json.dumps(newer))
    (results / "20261202-000000_families_b.json").write_text(json.dumps({"family": "b", "steps": {"tp": {}}}))
    (results / "20261203-000000_other_families.json").write_text(json.dumps({"models": [{"model": "a",
                                                                                           "steps": {"pp": {}}}]}))
    (cache / "d.json").write_text(json.dumps({"family": "d", "steps": {"pp": {"max_diff": 4.0}}}))
    records, carried = table_records(["a", "b", "c", "d"], str(cache), str(results), "families", "family")
    assert [r["steps"] for r in records] == [{"pp": {"max_diff": 1.0}}, {"tp": {}}, {}, {"pp": {"max_diff": 4.0}}]
    assert carried == {"a": "20261130-000000_families.json", "b": "20261202-000000_families_b.json"}
    text = carried_text(carried, "families were")
    assert text.startswith("2 families were not run") and "20261130-000000_families.json`: 1" in text
    labml = {"models": {"m": {"model": "m", "steps": {"cp": {}}}}}  # a results file of a few models, by name
    (results / "20261204-000000_other_families_m.json").write_text(json.dumps(labml))
    records, carried = table_records(["m", "a"], str(cache), str(results), "other_families", "model")
    assert [r["steps"] for r in records] == [{"cp": {}}, {"pp": {}}]
