"""Tier 1: the calibrated simulator and the tuner as plain data (no processes, no times measured).

The communication model of the replay engine (known makespans by hand), the calibration file, message sizes
from a manifest, stage costs of another split, the overhead fit, the tuner's search on a tiny grid with known
costs, and --memory-limit pruning."""
from __future__ import annotations

import json

import pytest

from tracepp.costs.calibrate import fit_overheads
from tracepp.costs.model import (Calibration, folder_record, interquartile_fraction, load_calibration, median_costs,
                                 message_bytes, predict_folder, relative_range, runtime_factors, split_costs,
                                 split_optimizer, write_calibration)
from tracepp.codegen.plan import build_plan
from tracepp.costs.measure_comm import fit
from tracepp.runtime.actions import Action, Topology
from tracepp.runtime.replay import CommModel, replay, validate
from tracepp.costs.measure_stages import NOTHING
from tracepp.costs.search import parse_bytes, tune

A = Action.parse
CHAIN2 = Topology.chain(2)


def gpipe2():
    """gpipe, 2 ranks, 2 microbatches, lowered by hand (as in test_replay)."""
    return {
        0: [A(t) for t in ("0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0B0", "0RECV_B1<1", "0B1")],
        1: [A(t) for t in ("1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1", "1B0", "1SEND_B0>0", "1B1", "1SEND_B1>0")],
    }


def _times(result):
    return {r: [(str(a), s, e) for _, a, s, e in entries] for r, entries in result.timeline.items()}


# ------------------------------------------------------------------------------- the comm model of the engine

def test_no_comm_model_is_the_old_engine():
    plain = replay(gpipe2(), [0, 1], CHAIN2)
    free = replay(gpipe2(), [0, 1], CHAIN2, comm=CommModel())
    assert plain.makespan == free.makespan == 9 and _times(plain) == _times(free)


@pytest.mark.parametrize("serial", [True, False])
def test_latency_known_makespan(serial):
    # every message 0.5: 0F0 ends 1, arrives 1.5; 1F1's input (sent at 2, its receive posted at 2.5) arrives 3;
    # 1B0's gradient (sent at 6) arrives 6.5 for 0B0 (6.5-8.5); 1B1's (sent at 8) waits for 0RECV_B1, posted
    # at 8.5: arrives 9, 0B1 9-11
    result = replay(gpipe2(), [0, 1], CHAIN2, comm=CommModel(default=(0.5, None), serial=serial))
    assert _times(result) == {
        0: [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 6.5, 8.5), ("0B1", 9, 11)],
        1: [("1F0", 1.5, 2.5), ("1F1", 3, 4), ("1B0", 4, 6), ("1B1", 6, 8)],
    }
    assert result.makespan == 11 and result.ends == {0: 11, 1: 9}


def test_bandwidth_bytes_and_overheads_known_makespan():
    # link 0-1: no latency, 100 bytes per unit; activations 100 bytes (1), gradients 200 bytes (2); F costs
    # 1 + 0.25 overhead; every comm op posted costs its rank 0.1
    model = CommModel(links={(0, 1): (0.0, 100.0)}, messages={(0, 1, "F"): (1, 100), (0, 1, "B"): (1, 200)},
                      compute_overhead={"F": 0.25}, op_overhead=0.1)
    result = replay(gpipe2(), [0, 1], CHAIN2, comm=model)
    assert _times(result) == {
        0: [("0F0", 0, 1.25), ("0F1", 1.35, 2.6), ("0B0", 10.05, 12.05), ("0B1", 14.15, 16.15)],
        1: [("1F0", 2.35, 3.6), ("1F1", 4.7, 5.95), ("1B0", 5.95, 7.95), ("1B1", 8.05, 10.05)],
    }
    assert result.makespan == pytest.approx(16.15)
    assert model.message(A("1SEND_B0>0")) == (1, 200) and model.message(A("1RECV_F0<0")) == (1, 100)


def test_serial_comm_queues_transfers_per_rank():
    # two sends posted together on rank 0 and two receives together on rank 1: one batch each, the ops of a batch
    # transfer in parallel from its match
    lists = {0: [A(t) for t in ("0F0", "0F1", "0SEND_F0>1", "0SEND_F1>1")],
             1: [A(t) for t in ("1RECV_F0<0", "1RECV_F1<0", "1F0", "1F1")]}
    serial = replay(lists, [0, 1], CHAIN2, comm=CommModel(default=(1.0, None), serial=True))
    independent = replay(lists, [0, 1], CHAIN2, comm=CommModel(default=(1.0, None), serial=False))
    # both ops transfer from the match at 2: arrive at 3
    assert _times(serial)[1] == [("1F0", 3, 4), ("1F1", 4, 5)]
    assert _times(independent)[1] == [("1F0", 3, 4), ("1F1", 4, 5)]
    split = {0: [A(t) for t in ("0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1")],
             1: [A(t) for t in ("1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1")]}
    slow = CommModel(default=(3.0, None), serial=True)
    # FIFO: rank 1's second receive (posted after 1F0 ends at 5) reaches the head only then: arrives 8
    assert _times(replay(split, [0, 1], CHAIN2, comm=slow))[1] == [("1F0", 4, 5), ("1F1", 8, 9)]


def test_validate_and_plans_keep_unit_costs():
    plan = build_plan("1f1b", 2, 2, 4)
    result = validate(plan.actions, plan.stage_to_rank, CHAIN2, 4)
    assert result.makespan == (4 + 1) * 3  # unit costs, comms free: (M + p - 1) (F + B)
    assert plan.costs == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


# ------------------------------------------------------------------------------- the calibration file

def _calibration():
    calibration = Calibration(
        comm={"backend": "gloo", "serial": False, "pairs": {"0-1": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}}},
        compute=[{"microbatch_size": 2, "costs": {"0F": 3.0, "0B": 6.0, "1F": 5.0, "1B": 10.0}},
                 {"microbatch_size": 4, "costs": {"0F": 5.0, "0B": 10.0, "1F": 9.0, "1B": 18.0}}],
        optimizer_s={"0": 0.5, "1": 1.0},
        overhead={"compute_action_s": 0.01, "comm_op_s": 0.01, "step_s": 0.1})
    return calibration


def test_calibration_round_trip(tmp_path):
    calibration = _calibration()
    path = write_calibration(str(tmp_path), calibration)
    assert path.endswith("calibration.json")
    again = load_calibration(str(tmp_path))
    assert again.to_json() == calibration.to_json()
    # two microbatch sizes: a line per (stage, kind); split halves from B where I and W were not measured
    lines = again.stage_cost_lines()
    assert lines[(0, "F")] == pytest.approx((1.0, 1.0)) and lines[(1, "B")] == pytest.approx((2.0, 4.0))
    assert lines[(1, "I")] == pytest.approx((1.0, 2.0))
    assert again.stage_costs(3)[(1, "F")] == pytest.approx(7.0)
    assert again.link(0, 1) == (1e-4, 1e9) and again.link(1, 0) == (1e-4, 1e9)
    assert again.link(2, 3) == (1e-4, 1e9)  # a pair not measured: the pairs' median
    assert again.overheads() == (0.01, 0.01, 0.1)
    (tmp_path / "bad.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="tracepp calibrate"):
        load_calibration(str(tmp_path / "bad.json"))


def test_one_microbatch_size_is_proportional():
    calibration = Calibration(compute=[{"microbatch_size": 4, "costs": {"0F": 2.0}}])
    assert calibration.stage_costs(8)[(0, "F")] == pytest.approx(4.0)


def test_ping_pong_fit_recovers_latency_and_bandwidth():
    points = [(size, 50e-6 + size / 2e9) for size in (4096, 65536, 1048576)]
    result = fit(points)
    assert result["latency_s"] == pytest.approx(50e-6) and result["bandwidth_bytes_per_s"] == pytest.approx(2e9)


# ------------------------------------------------------------------------------- a synthetic folder

def _manifest(schedule="1f1b", num_microbatches=4, batch_size=16):
    """A 2-stage, 4-segment model's manifest as the tuner and the predictor read it: equal blocks, the boundary
    a [b, 8] float tensor, stages 0 = segments 0-1, 1 = segments 2-3."""
    plan = build_plan(schedule, 2, 2, num_microbatches).to_json()
    segment = {"forward_flops": 100, "num_params": 1000, "param_bytes": 4000, "activation_bytes": 1000,
               "cut_tensors": 1, "cut_bytes": 32 * (batch_size // num_microbatches), "cut_grad_tensors": 1,
               "cut_grad_bytes": 32 * (batch_size // num_microbatches)}
    segments = [dict(segment, begins=name, stage=stage)
                for name, stage in ((None, 0), ("blocks.1", 0), ("blocks.2", 1), ("blocks.3", 1))]
    return {"batch_size": batch_size, "training": True, "model_sha256": "abc", "symbols": {}, "batch_symbol": None,
            "values": {"h": {"producer": 0, "consumers": [1], "shape": [batch_size // num_microbatches, 8],
                             "dtype": "float32", "requires_grad": True}},
            "stages": [{"forward_flops": 200}, {"forward_flops": 200}], "segments": segments, "plan": plan}


def test_message_bytes_from_the_manifest():
    manifest = _manifest()  # microbatches of 4 samples: [4, 8] float32 = 128 bytes
    assert message_bytes(manifest) == {(0, 1, "F"): (1, 128), (0, 1, "B"): (1, 128)}
    assert message_bytes(manifest, microbatch_size=8) == {(0, 1, "F"): (1, 256), (0, 1, "B"): (1, 256)}
    assert message_bytes(manifest, precision="bf16")[(0, 1, "F")] == (1, 64)
    dynamic = dict(manifest, symbols={"s_batch": {"min": 1, "max": 64}, "s_seq": {"min": 2, "max": 10}},
                   batch_symbol="s_batch",
                   values={"h": {"producer": 0, "consumers": [1], "shape": ["s_batch", "s_seq", 2], "dtype": "int64",
                                 "requires_grad": False}})
    assert message_bytes(dynamic, microbatch_size=3) == {(0, 1, "F"): (1, 3 * 10 * 2 * 8)}


def test_costs_of_another_split_from_the_calibrated_segments():
    manifest = _manifest()
    manifest["segments"][1]["forward_flops"] = 300  # stage 0's segments weigh 1:3
    calibration = Calibration(compute=[{"microbatch_size": 4, "costs": {"0F": 4.0, "1F": 2.0}}],
                              optimizer_s={"0": 2.0, "1": 1.0}, folder=folder_record(manifest))
    assert split_costs(calibration, [0, 0, 1, 1], 4) == pytest.approx({(0, "F"): 4.0, (1, "F"): 2.0})
    # segment 1 (3/4 of stage 0's time) moves to stage 1; at twice the microbatch, twice the time (one size)
    assert split_costs(calibration, [0, 1, 1, 1], 8) == pytest.approx({(0, "F"): 2.0, (1, "F"): 10.0})
    assert split_optimizer(calibration, [0, 1, 1, 1]) == pytest.approx({0: 1.0, 1: 2.0})
    # the folder's own plan predicted from its calibration: comms free, overheads 0 -> the replay itself
    prediction = predict_folder(manifest, calibration)
    assert prediction.step_s == pytest.approx(max(
        prediction.ends[r] + prediction.optimizer_s[r] for r in (0, 1)))


def test_runtime_factors_are_the_median_ratio_per_kind():
    plain = {"0F": 1.0, "0B": 2.0, "0I": NOTHING, "0W": 2.0, "1F": 1.0, "1B": 2.0, "1I": 1.0, "1W": 1.0,
             "2F": 2.0, "2B": 4.0, "2I": 2.0, "2W": 2.0}
    runtime = {"0F": 1.1, "0B": 2.0, "0I": 2e-5, "0W": 2.4, "1F": 0.9, "1B": 2.2, "1I": 1.3, "1W": 1.1,
               "2F": 2.0, "2B": 4.4, "2I": 2.4, "2W": 2.4}
    factors = runtime_factors(plain, runtime)
    # F: 1.1, 0.9, 1.0; B: 1.0, 1.1, 1.1; I: stage 0 has none (below the floor), 1.3 and 1.2; W: 1.2, 1.1, 1.2
    assert factors == pytest.approx({"F": 1.0, "B": 1.1, "I": 1.25, "W": 1.2})
    assert runtime_factors({"0F": 1.0}, {}) == {}  # nothing measured through the executor: no factor
    # a W timed right after its own I is compared with the same plain W, as a kind of its own
    runtime.update({"1W_after_I": 1.05, "2W_after_I": 2.2})
    assert runtime_factors(plain, runtime)["W_after_I"] == pytest.approx(1.075)
    assert runtime_factors(plain, runtime)["W"] == pytest.approx(1.2)


def test_a_w_right_after_its_own_i_is_priced_as_such():
    from tracepp.costs.model import W_AFTER_I
    from tracepp.runtime.replay import W_AFTER_I as REPLAY_W_AFTER_I, cost_of

    assert W_AFTER_I == REPLAY_W_AFTER_I == "W_after_I"
    costs = {(0, "I"): 1.0, (0, "W"): 2.0, (0, W_AFTER_I): 1.5}
    assert cost_of(A("0W3"), costs) == 2.0 and cost_of(A("0W3"), costs, after_own_input=True) == 1.5
    assert cost_of(A("0W3"), {"W": 2.0}, after_own_input=True) == 2.0  # not measured: any W's cost
    # one rank, one stage: the W of microbatch 0 follows its I, the W of microbatch 1 follows another I
    plan = {0: [A(t) for t in ("0F0", "0F1", "0I0", "0W0", "0I1", "0F2", "0I2", "0W1", "0W2")]}
    # (0W1 runs right after an I, of another microbatch; 0W2 after a W)
    costs.update({(0, "F"): 0.5})
    ends = {str(a): e for _, a, _s, e in replay(plan, [0], Topology.chain(1), costs).timeline[0]}
    assert ends["0W0"] - ends["0I0"] == 1.5 and ends["0W1"] - ends["0I2"] == 2.0 and ends["0W2"] - ends["0W1"] == 2.0
    calibration = Calibration(runtime={"factors": {"W": 1.2, W_AFTER_I: 1.05}})
    priced = calibration.runtime_costs({(0, "I"): 1.0, (0, "W"): 2.0, (1, "W"): 4.0})
    assert priced == pytest.approx({(0, "I"): 1.0, (0, "W"): 2.4, (1, "W"): 4.8, (0, W_AFTER_I): 2.1,
                                    (1, W_AFTER_I): 4.2})
    assert Calibration(runtime={"factors": {"W": 1.2}}).runtime_costs({(0, "W"): 1.0}) == pytest.approx({(0, "W"): 1.2})


def test_the_runtime_factors_scale_the_compute_of_every_prediction(tmp_path):
    manifest = _manifest()
    calibration = Calibration(compute=[{"microbatch_size": 4, "costs": {"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}}],
                              folder=folder_record(manifest))
    assert predict_folder(manifest, calibration).step_s == pytest.approx(15.0)  # (M + p - 1) (F + B)
    calibration.runtime = {"factors": {"F": 1.5, "B": 1.25}}
    assert calibration.runtime_factors() == {"F": 1.5, "B": 1.25, "I": 1.0, "W": 1.0}
    assert predict_folder(manifest, calibration).step_s == pytest.approx(5 * (1.5 + 2.5))
    # the tuner prices other splits through the same simulator: the factors apply there too
    plain = split_costs(calibration, [0, 0, 1, 1], 4)  # the stage functions' own costs; scaled when simulated
    assert (plain[(0, "F")], plain[(0, "B")]) == pytest.approx((1.0, 2.0))
    kept, _dropped, _failed = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4])
    own = [c for c in kept if c.num_stages == 2 and c.split_points == ["blocks.2"]]
    assert own and own[0].step_s == pytest.approx(20.0)
    write_calibration(str(tmp_path), calibration)  # kept in the file
    assert load_calibration(str(tmp_path)).runtime_factors()["F"] == 1.5


@pytest.mark.parametrize("mode", ["delay", "busy", "scale"])
def test_overhead_fit_reproduces_the_measured_step(mode):
    manifest = _manifest()
    calibration = Calibration(compute=[{"microbatch_size": 4, "costs": {"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}}],
                              folder=folder_record(manifest))
    base = predict_folder(manifest, calibration).step_s
    assert base == pytest.approx(15.0)  # (M + p - 1) (F + B)
    result = fit_overheads(manifest, calibration, 20.0, mode=mode)
    assert result["mode"] == mode and result["value"] > 0 and result["step_s"] == 0
    fitted = {"delay": "message_delay_s", "busy": "compute_action_s", "scale": "compute_scale"}[mode]
    assert result[fitted] == result["value"] and calibration.overhead[fitted] == result["value"]
    assert predict_folder(manifest, calibration).step_s == pytest.approx(20.0, rel=1e-3)
    if mode == "scale":  # every compute action 1/3 slower: the 15.0 of compute alone becomes 20.0
        assert result["value"] == pytest.approx(1 / 3, rel=1e-3)
    result = fit_overheads(manifest, calibration, 13.0, mode=mode)  # a little faster than the model without them
    assert result["value"] == 0 and result["step_s"] == pytest.approx(-2.0)
    result = fit_overheads(manifest, calibration, 0.015, mode=mode)  # costs of another machine: not fitted
    assert result["value"] == 0 and result["step_s"] == 0


def test_a_delay_cannot_fit_a_plan_without_messages():
    manifest = _manifest()
    one_rank = build_plan("interleaved-1f1b", 1, 2, 4).to_json()
    manifest = dict(manifest, plan=one_rank)
    calibration = Calibration(compute=[{"microbatch_size": 4, "costs": {"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}}],
                              folder=folder_record(manifest))
    result = fit_overheads(manifest, calibration, 30.0, mode="delay")
    assert result["mode"] == "busy" and result["value"] > 0
    assert predict_folder(manifest, calibration).step_s == pytest.approx(30.0, rel=1e-3)


def test_noise_measures():
    assert relative_range([9.0, 10.0, 12.0]) == pytest.approx(0.3)
    assert relative_range([5.0]) is None and relative_range([0.0, 0.0]) is None
    # inclusive quartiles of 18..23: 19.25 and 21.75 around a median of 20.5
    assert interquartile_fraction([23, 18, 19, 20, 21, 22]) == pytest.approx(2.5 / 20.5)
    assert interquartile_fraction([1.0, 2.0, 3.0]) is None
    assert median_costs([{"0F": 1.0, "0B": 4.0}, {"0F": 3.0, "0B": 2.0}, {"0F": 2.0}]) == {"0F": 2.0, "0B": 3.0}
    calibration = Calibration(noise={"compute": 0.04, "run": 0.12, "compute_steps_s": [1.0, 1.04]})
    assert calibration.noise_fraction() == pytest.approx(0.12)
    assert Calibration.from_json(calibration.to_json()).noise == calibration.noise
    assert Calibration().noise_fraction() is None


def test_calibrate_repeats_the_stage_costs_around_the_run_and_records_the_noise(tmp_path, monkeypatch):
    """`tracepp calibrate` without --costs: the plain-autograd measurement twice before the calibration run and once
    after, the median used, the spread of the comm-free step over the three and the run's interquartile spread
    recorded as the machine's noise, and a warning note above 10%."""
    import tracepp.costs.calibrate as calibrate_module
    import tracepp.codegen.manifest as manifest_file

    manifest = _manifest()
    monkeypatch.setattr(manifest_file, "load_manifest", lambda path: manifest)
    base = {"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}
    measurements = iter([{k: v * factor for k, v in base.items()} for factor in (1.2, 1.0, 0.9)])
    calls = []

    def measured(out_dir):
        calls.append("costs")
        return next(measurements)

    def runtime(out_dir):  # tracepp's executor: B 10% slower than plain autograd, F as fast
        calls.append("runtime")
        return {"costs": base, "runtime_costs": {k: v * (1.1 if k.endswith("B") else 1.0) for k, v in base.items()}}

    def run(out_dir, steps, nproc):
        calls.append("run")
        return [30.0, 30.0, 30.0, 23, 18, 19, 20, 21, 22]  # 3 warm-up steps dropped; median 20.5

    monkeypatch.setattr(calibrate_module, "measured_stage_costs", measured)
    monkeypatch.setattr(calibrate_module, "measured_runtime_costs", runtime)
    monkeypatch.setattr(calibrate_module, "run_folder", run)
    lines = []
    calibrate_module.calibrate(str(tmp_path), skip_comm=True, fit_steps=9, paired_steps=0, log=lines.append)
    assert calls == ["costs", "costs", "runtime", "run", "costs"]
    calibration = load_calibration(str(tmp_path))
    assert calibration.compute[0]["costs"] == base  # the median of 1.2, 1.0 and 0.9 times the costs
    assert calibration.runtime_factors() == pytest.approx({"F": 1.0, "B": 1.1, "I": 1.0, "W": 1.0})
    assert any("B x1.100" in line for line in lines), lines
    # the comm-free step is (M + p - 1)(F + 1.1 B) = 16 s at 1.0: 19.2, 16 and 14.4 s, a range of 30% of the median
    assert calibration.noise["compute_steps_s"] == pytest.approx([19.2, 16.0, 14.4])
    assert calibration.noise["compute"] == pytest.approx(0.3)
    assert calibration.noise["run"] == pytest.approx(2.5 / 20.5)
    assert calibration.noise_fraction() == pytest.approx(0.3)
    assert any("moved by 30%" in note for note in calibration.notes), calibration.notes
    assert any("warning: this machine's speed moved by 30%" in line for line in lines), lines
    # fitted against the median of the 1.0 costs: 20.5 s measured against 16 s simulated
    assert predict_folder(manifest, calibration).step_s == pytest.approx(20.5, rel=1e-3)


# ------------------------------------------------------------------------------- the tuner

def _tuning_calibration(manifest):
    # every segment: F = 0.5 + 0.5 b, B = twice that (so a stage of 2 segments: F = 1 + b, B = 2 + 2b); comms and
    # overheads free. For 1F1B or GPipe on 2 ranks the step is (M + 1)(F + B) = 3 (M + 1)(1 + 16 / M): least at
    # M = 4 (75); M = 2: 81, M = 8: 81
    return Calibration(comm={"serial": True, "pairs": {}},
                       compute=[{"microbatch_size": 1, "costs": {"0F": 2.0, "0B": 4.0, "1F": 2.0, "1B": 4.0}},
                                {"microbatch_size": 2, "costs": {"0F": 3.0, "0B": 6.0, "1F": 3.0, "1B": 6.0}}],
                       folder=folder_record(manifest))


def test_tuner_finds_the_known_best_on_a_tiny_grid():
    manifest = _manifest()
    kept, dropped, failed = tune(manifest, _tuning_calibration(manifest), schedules=["gpipe", "1f1b"],
                                 microbatch_counts=[2, 4, 8])
    assert not dropped and not failed
    best = kept[0]
    assert (best.schedule, best.num_stages, best.num_microbatches) == ("gpipe", 2, 4)  # ties: table order
    assert best.step_s == pytest.approx(75.0) and best.split_points == ["blocks.2"]
    assert [(c.schedule, c.num_microbatches, round(c.step_s, 6)) for c in kept[:2]] == [("gpipe", 4, 75.0),
                                                                                     ("1f1b", 4, 75.0)]
    assert {round(c.step_s, 6) for c in kept if c.num_microbatches in (2, 8)} == {81.0}
    # deterministic
    again = tune(manifest, _tuning_calibration(manifest), schedules=["gpipe", "1f1b"], microbatch_counts=[2, 4, 8])[0]
    assert [c.to_json() for c in again] == [c.to_json() for c in kept]


def test_memory_limit_prunes_what_does_not_fit():
    manifest = _manifest()
    calibration = _tuning_calibration(manifest)
    kept, _, _ = tune(manifest, calibration, schedules=["gpipe", "1f1b"], microbatch_counts=[4],
                      optimizer_bytes_per_param=0)
    peaks = {c.schedule: c.peak_memory for c in kept}
    # rank 0: parameters + gradients of 2 segments (16000) + activations of the microbatches in flight at 4 samples
    # (2 segments x 1000 bytes per traced microbatch of 4): GPipe keeps all 4, 1F1B 2
    assert peaks["gpipe"][0] == 16000 + 4 * 2000 and peaks["1f1b"][0] == 16000 + 2 * 2000
    kept, dropped, _ = tune(manifest, calibration, schedules=["gpipe", "1f1b"], microbatch_counts=[4],
                            optimizer_bytes_per_param=0, memory_limit=22000)
    assert [c.schedule for c in kept] == ["1f1b"] and [c.schedule for c in dropped] == ["gpipe"]
    assert parse_bytes("20GB") == 20 * 10 ** 9 and parse_bytes("512MiB") == 512 * 2 ** 20
    with pytest.raises(ValueError, match="memory-limit"):
        parse_bytes("lots")


def _counted(manifest: dict) -> dict:
    """The same manifest with the split's counted figures per segment and checkpointing mode (issue 46): each
    segment keeps 1000 bytes per traced microbatch with none, 300 with selective, 0 with full (the stage's input
    alone); its stage's temporaries 100 bytes forward, 200 backward, more when it recomputes."""
    for segment in manifest["segments"]:
        segment["memory"] = {
            "none": {"kept": 1000, "forward_peak": 100, "backward_peak": 200, "backward_peak_first": 200},
            "selective": {"kept": 300, "forward_peak": 100, "backward_peak": 700, "backward_peak_first": 700},
            "full": {"kept": 0, "forward_peak": 100, "backward_peak": 1200, "backward_peak_first": 1200}}
    return manifest


def test_the_tuner_walks_each_ranks_timeline_and_checkpoints_the_stages_that_hold_most():
    manifest = _counted(_manifest())
    calibration = _tuning_calibration(manifest)
    kept, _, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], optimizer_bytes_per_param=0)
    counted = kept[0].peak_memory
    # rank 0 under 1F1B: parameters (8000) and the outputs sent at the end of the step stay; two microbatches of
    # 2000 bytes in flight and then the gradients (8000) with a backward's temporaries: more than the bound's
    assert counted[0] > 8000 + 2 * 2000 and counted[1] > 8000 + 2000
    # a limit under rank 0's peak: rank 0's stage (2 microbatches in flight) is checkpointed first, rank 1's
    # (one at a time) is not, and the step pays for the recomputation
    limit = counted[0] - 1000
    fitted, dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4],
                              optimizer_bytes_per_param=0, memory_limit=limit)
    assert not dropped
    best = fitted[0]
    assert best.recompute[0] != "none" and best.recompute[1] == "none" and best.checkpointing.startswith(
        best.recompute[0] + ",")
    assert max(best.peak_memory.values()) <= limit and best.step_s > kept[0].step_s
    assert best.to_json()["activation_checkpointing"] == best.checkpointing
    # a limit nothing meets: dropped, whatever checkpointing does
    _kept, dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4],
                             optimizer_bytes_per_param=0, memory_limit=1000)
    assert dropped and dropped[0].recompute == ["full", "full"]


def test_checkpointing_trials_price_only_the_rank_they_change(monkeypatch):
    """Issue 56: a trial checkpoints a stage of the worst rank, and a stage's figures depend on its own mode only:
    the trial walks that rank's timeline alone (the 671B tune's 90 plans: 100 -> 39 s), and chooses what walking
    every rank chose."""
    from tracepp.codegen import peak
    from tracepp.costs import search

    manifest = _counted(_manifest())
    calibration = _tuning_calibration(manifest)
    kept, _, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], optimizer_bytes_per_param=0)
    limit = kept[0].peak_memory[0] - 1000
    walked = []
    original = peak.rank_peak
    monkeypatch.setattr(peak, "rank_peak", lambda *a, **k: walked.append(1) or original(*a, **k))

    def run():
        walked.clear()
        fitted, _, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4],
                            optimizer_bytes_per_param=0, memory_limit=limit)
        return [(c.recompute, c.peak_memory, c.step_s) for c in fitted], len(walked)
    chosen, walks = run()
    memory = search._memory
    monkeypatch.setattr(search, "_memory", lambda *a, **k: memory(*a, **dict(k, ranks=None)))
    every_rank, walks_every_rank = run()
    assert chosen == every_rank and chosen[0][0][0] != "none"
    assert walks < walks_every_rank


def test_segment_table_counts_the_gradient_tensors_a_cut_sends_back(tmp_path):
    """A cut crossed by a skip connection sends two tensors forward and two gradients back: the tuner prices
    both messages of each direction (the table once counted gradient bytes but not gradient tensors)."""
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from util import model_path

    manifest = split_model(model_path("skip3"), str(tmp_path / "out"), layout=Layout(pp=3))
    cuts = {s["begins"]: (s["cut_tensors"], s["cut_grad_tensors"], s["cut_bytes"], s["cut_grad_bytes"])
            for s in manifest["segments"]}
    assert cuts["mid1"] == (1, 1, 96, 96)  # h0 only
    assert cuts["mid2"] == (2, 2, 192, 192)  # h0 (the skip) and h1


def test_calibrate_fits_the_overhead_per_paired_step(tmp_path, monkeypatch):
    """With paired steps, the overhead is the median of one fit per paired step, each to the stage costs measured
    around it, not the fit of the run's median step (here measured in a slower spell) to costs measured apart."""
    import tracepp.costs.calibrate as calibrate_module
    import tracepp.codegen.manifest as manifest_file

    manifest = _manifest()
    monkeypatch.setattr(manifest_file, "load_manifest", lambda path: manifest)
    base = {"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}  # 15 s per step without overheads (1F1B, M = 4)
    monkeypatch.setattr(calibrate_module, "measured_stage_costs", lambda out_dir: dict(base))
    double = {key: 2 * value for key, value in base.items()}  # a slower spell: 30 s without overheads

    def run(out_dir, steps, nproc, paired_steps, num_stages):
        assert (steps, paired_steps, num_stages) == (6, 3, 2)
        paired = {"step_times": [40.0, 40.0, 40.0], "rounds": [double] * 4, "errors": []}
        return [50.0] * 6, paired  # the run's median: 50 s, against 15 s from the costs measured apart

    monkeypatch.setattr(calibrate_module, "run_folder_paired", run)
    lines = []
    calibration = calibrate_module.calibrate(str(tmp_path), skip_comm=True, fit_steps=6, paired_steps=3,
                                             runtime=False, mode="scale", log=lines.append)
    # each paired step: 40 s against 30 s simulated with its own costs, a third slower; not 50 / 15 - 1
    assert calibration.overhead["compute_scale"] == pytest.approx(1 / 3, rel=1e-3)
    assert calibration.overhead["paired_fits"] == pytest.approx([1 / 3] * 3, rel=1e-3)
    assert "paired step" in calibration.overhead["source"] and calibration.overhead["measured_step_s"] == 50.0
    assert any("the median of 3 paired steps' fits" in line for line in lines), lines
    assert load_calibration(str(tmp_path)).overhead["compute_scale"] == pytest.approx(1 / 3, rel=1e-3)


def _tp_manifest(sequence_figures: bool = True):
    """``_manifest`` with tensor-parallel figures at tp 2 on every segment (made up): the whole segment is
    sharded; 600 of its 1000 activation bytes are computed on shards, 400 more are sharded by sequence
    parallelism; one 2 MB all-reduce (tp alone) or reduce-scatter and all-gather (sequence parallelism)."""
    manifest = _manifest()
    for seg in manifest["segments"]:
        figures = {"sharded_flops": 100, "sharded_params": 1000, "sharded_param_bytes": 4000,
                   "all_reduce": [1, 2e6], "all_reduce_backward": [1, 2e6], "all_gather": [0, 0],
                   "sharded_activation_bytes": 600}
        if sequence_figures:
            figures["sequence_parallel"] = dict(
                figures, all_reduce=[0, 0], all_reduce_backward=[0, 0], sequence_activation_bytes=400,
                reduce_scatter=[1, 2e6], all_gather_sequence=[1, 2e6], cut_sequence_bytes=seg["cut_bytes"],
                cut_sequence_grad_bytes=seg["cut_grad_bytes"])
        seg["tp"] = {"2": figures}
    return manifest


def _collective_calibration(manifest, all_gather_bandwidth):
    # free compute overheads, free point-to-point links; ring steps of 1 MB/s for the all-reduce (and the
    # reduce-scatter, which shares its step) and ``all_gather_bandwidth`` for the all-gather
    calibration = _tuning_calibration(manifest)
    calibration.comm["collectives"] = {
        "all_reduce": {"step_latency_s": 0.0, "step_bandwidth_bytes_per_s": 1e6},
        "all_gather": {"step_latency_s": 0.0, "step_bandwidth_bytes_per_s": all_gather_bandwidth}}
    return calibration


def test_tuner_prices_sequence_parallelism_and_chooses_it_when_memory_needs_it():
    from tracepp.costs.search import collective_s, tp_costs

    manifest = _tp_manifest()
    # a ring reduce-scatter and an all-gather are tp - 1 steps of a 1/tp piece each: together an all-reduce
    links = {"all_reduce": (0.0, 1e6), "all_gather": (0.0, 1e6)}
    assert collective_s("reduce_scatter", 1, 2e6, 2, links) + collective_s("all_gather", 1, 2e6, 2, links) == \
        pytest.approx(collective_s("all_reduce", 1, 2e6, 2, links)) == pytest.approx(2.0)
    costs = {(0, "F"): 10.0, (0, "B"): 20.0, (1, "F"): 10.0, (1, "B"): 20.0}
    plain = tp_costs(manifest, (0, 0, 1, 1), costs, 4, 2, links)
    sequence = tp_costs(manifest, (0, 0, 1, 1), costs, 4, 2, links, sequence_parallel=True)
    assert plain == pytest.approx(sequence)  # compute halved, 2 x 2 s of collectives each way, either way
    assert plain[(0, "F")] == pytest.approx(5.0 + 4.0) and plain[(0, "B")] == pytest.approx(10.0 + 4.0)

    # an all-gather twice as slow as the all-reduce's step: sequence parallelism costs 1 s more per collective
    # pair, so without a limit tp 2 alone ranks first; its activations (600 of 1000 bytes per segment halved,
    # against 1000 with sequence parallelism) need more memory
    calibration = _collective_calibration(manifest, 0.5e6)
    kept, dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4],
                            optimizer_bytes_per_param=0, tp_sizes=[1, 2])
    assert not dropped
    layouts = [(c.tp, c.sequence_parallel) for c in kept]
    assert sorted(layouts) == [(1, False), (2, False), (2, True)]
    assert layouts.index((2, False)) < layouts.index((2, True))
    peak = {(c.tp, c.sequence_parallel): c.peak_memory[0] for c in kept}
    # rank 0: parameters and gradients of 2 segments (16000 at tp 1, halved at tp 2) + 2 microbatches of 4
    # samples in flight (1F1B) x 2 segments x the activations left per rank
    assert peak[(1, False)] == 16000 + 2 * 2 * 1000
    assert peak[(2, False)] == 8000 + 2 * 2 * (1000 - 600 / 2)
    assert peak[(2, True)] == 8000 + 2 * 2 * (1000 - 1000 / 2)
    assert kept[0].to_json()["sequence_parallel"] is False
    # a limit only sequence parallelism meets: it is chosen
    kept, dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4],
                            optimizer_bytes_per_param=0, tp_sizes=[1, 2], memory_limit=10500)
    assert [(c.tp, c.sequence_parallel) for c in kept] == [(2, True)]
    assert sorted((c.tp, c.sequence_parallel) for c in dropped) == [(1, False), (2, False)]
    # the boundary carries the sequence shard: the plan's messages are half the bytes
    from tracepp.costs.search import _messages
    whole = _messages(manifest, (0, 0, 1, 1), 4, "fp32", False, 2, False)
    shard = _messages(manifest, (0, 0, 1, 1), 4, "fp32", False, 2, True)
    assert {k: v[1] / 2 for k, v in whole.items()} == {k: v[1] for k, v in shard.items()} and whole
    own = _messages(manifest, (0, 0, 1, 1), 4, "fp32", True, 2, True)  # the folder's own split: its values
    assert own == {(0, 1, "F"): (1, 64.0), (0, 1, "B"): (1, 64.0)}


def test_tuner_without_activation_or_sequence_figures_keeps_the_old_prices():
    # a split by an older tracepp: no activation figures (activations stay whole), no sequence-parallel walk
    manifest = _tp_manifest(sequence_figures=False)
    for seg in manifest["segments"]:
        del seg["tp"]["2"]["sharded_activation_bytes"]
    calibration = _collective_calibration(manifest, 1e6)
    kept, _, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], optimizer_bytes_per_param=0,
                      tp_sizes=[1, 2])
    assert sorted((c.tp, c.sequence_parallel) for c in kept) == [(1, False), (2, False)]
    assert next(c for c in kept if c.tp == 2).peak_memory[0] == 8000 + 2 * 2 * 1000


def _ep_manifest(dp=4, mode="fsdp", experts=8):
    """``_manifest`` at ``--dp dp`` with routed experts in every segment (made up): 800 of its 1000 parameters
    (3200 of 4000 bytes) are one block's expert weights; 64 (token, expert) rows of 32 bytes each way per
    microbatch of 4 samples."""
    manifest = _manifest()
    manifest["plan"]["mesh"] = {"dp": dp, "pp": 2, "mode": mode, "shard": 2 if mode == "hsdp" else None,
                                "order": "pp-inner"}
    for index, seg in enumerate(manifest["segments"]):
        seg["ep"] = {"params": 800, "param_bytes": 3200, "flops": 50, "blocks": [
            {"name": f"blocks.{index}.experts", "experts": experts, "pairs": 64, "row_bytes": 32,
             "out_row_bytes": 32, "refused": ""}]}
    return manifest


def test_all_to_all_is_priced_as_ep_minus_one_messages_of_one_ep_th():
    from tracepp.costs.search import all_to_all_s, collective_links

    link = (0.001, 1e6)
    assert all_to_all_s(1, 4e6, 1, link) == 0.0
    assert all_to_all_s(1, 4e6, 2, link) == pytest.approx(0.001 + 2.0)  # the 2-rank fit: one message of half
    assert all_to_all_s(1, 4e6, 4, link) == pytest.approx(3 * (0.001 + 1.0))
    assert all_to_all_s(3, 4e6, 4, link) == pytest.approx(3 * (3 * 0.001 + 1.0))  # bytes summed over the calls
    calibration = Calibration(comm={"serial": False, "pairs": {"0-1": {"latency_s": 5e-5,
                                                                       "bandwidth_bytes_per_s": 1e9}},
                                    "collectives": {"all_to_all": {"step_latency_s": 2e-4,
                                                                   "step_bandwidth_bytes_per_s": 5e8}}})
    assert collective_links(calibration)["all_to_all"] == (2e-4, 5e8)
    del calibration.comm["collectives"]  # an older calibration: one point-to-point message
    assert collective_links(calibration)["all_to_all"] == (5e-5, 1e9)


def test_expert_parallel_pricing_memory_exchange_and_data_parallel_traffic():
    from tracepp.costs.search import expert_exchange_s, expert_step_s, held_bytes, _sharded_share
    from tracepp.runtime.mesh import Layout

    manifest = _ep_manifest()
    split = (0, 0, 1, 1)
    links = {op: (0.0, 1e6) for op in ("all_reduce", "all_gather", "all_to_all")}
    # per microbatch (4 samples, as traced) and stage (2 blocks): forward the counts (8 x int64) and the rows out
    # and back (64 x 32 bytes each), backward the two row exchanges; 1/ep of each stays home
    exchange = expert_exchange_s(manifest, split, 4, 2, links)
    block_forward = (64 + 2 * 64 * 32) / 2 / 1e6
    assert exchange[0] == pytest.approx((2 * block_forward, 2 * (2 * 64 * 32) / 2 / 1e6))
    # what moves is the manifest's all_to_all_bytes: pairs x (row + out row) x (ep - 1) / ep each way
    assert exchange[0][1] * 1e6 / 2 == 64 * (32 + 32) * (2 - 1) // 2
    assert expert_exchange_s(manifest, split, 8, 4, links)[1][1] == pytest.approx(
        2 * 3 * (2 * 2 * 64 * 32 / 4) / 1e6)  # twice the rows at 8 samples, 3 messages of 1/4
    assert expert_exchange_s(manifest, split, 4, 1, links) == {}
    # per step: FSDP gathers the experts (6400 bytes per stage) and reduce-scatters their gradients over dp 4 at
    # ep 1; at ep 2 each pair of ranks holding the same experts all-reduces their 3200 bytes; at ep 4 nothing
    fsdp = Layout(pp=2, dp=4)
    assert expert_step_s(manifest, split, fsdp, 1, links)[0] == pytest.approx(2 * 3 * 6400 / 4 / 1e6)
    assert expert_step_s(manifest, split, fsdp, 2, links)[0] == pytest.approx(2 * 1 * 3200 / 2 / 1e6)
    assert expert_step_s(manifest, split, fsdp, 4, links)[0] == 0.0
    assert expert_step_s(manifest, split, Layout(pp=2, dp=4, dp_mode="ddp"), 1, links)[0] == pytest.approx(
        2 * 3 * 6400 / 4 / 1e6)  # DDP's all-reduce: the same ring bytes as FSDP's gather and scatter
    # memory: FSDP keeps weights and gradients whole through the step beside its 1/dp of weights and state
    assert held_bytes(6400, 1600, fsdp, True, 8) == 6400 + 6400 + (6400 + 12800) / 4
    assert held_bytes(6400, 1600, fsdp, True, 8, experts_over=2) == (6400 + 6400 + 12800) / 2
    assert held_bytes(6400, 1600, Layout(pp=2, dp=4, dp_mode="ddp"), True, 8) == 6400 + 6400 + 12800
    assert held_bytes(6400, 1600, fsdp, False, 8) == 6400 + 6400 / 4
    # --mixed-precision params at bf16: FSDP gathers the bf16 copy (half the fp32 weights); DDP and no dp hold the
    # copy beside the fp32 weights; experts (outside FSDP) their 1/ep of it
    assert held_bytes(6400, 1600, fsdp, True, 8, copy=0.5) == 3200 + 6400 + (6400 + 12800) / 4
    assert held_bytes(6400, 1600, Layout(pp=2, dp=4, dp_mode="ddp"), True, 8, copy=0.5) == 6400 + 6400 + 12800 + 3200
    assert held_bytes(6400, 1600, fsdp, True, 8, experts_over=2, copy=0.5) == (6400 + 6400 + 12800 + 3200) / 2
    # the optimizer updates 1/dp of the experts under FSDP, 1/ep of them with ep: at dp 4, ep 2 updates more
    assert _sharded_share(manifest, split, 0, 1, False, 2, fsdp) == pytest.approx((400 / 4 + 1600 / 2) / (2000 / 4))
    assert _sharded_share(manifest, split, 0, 1, False, 4, fsdp) == pytest.approx(1.0)


def test_tuner_prices_ep_sizes_and_a_memory_limit_chooses_one():
    manifest = _ep_manifest()
    calibration = _tuning_calibration(manifest)
    kept, dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], ep_sizes=[1, 2, 4])
    assert not dropped and [c.ep for c in kept] == [1, 2, 4]  # free comms: a tie, the smaller ep first
    assert len({round(c.step_s, 9) for c in kept}) == 1  # expert FLOPs per rank are the same at every ep
    peak = {c.ep: c.peak_memory[0] for c in kept}
    # rank 0 (stage 0: 2 segments): other parameters 1600 bytes (400) held as FSDP does; experts 6400 (1600); 1F1B
    # keeps 2 microbatches x 2 segments x 1000 activation bytes
    others = 1600 + 1600 + (1600 + 3200) / 4
    assert peak[1] == int(others + 6400 + 6400 + (6400 + 12800) / 4 + 4000)
    assert peak[2] == int(others + (6400 + 6400 + 12800) / 2 + 4000)
    assert peak[4] == int(others + (6400 + 6400 + 12800) / 4 + 4000)
    kept, dropped, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], ep_sizes=[1, 2, 4],
                            memory_limit=(peak[2] + peak[4]) // 2)
    assert [c.ep for c in kept] == [4] and sorted(c.ep for c in dropped) == [1, 2]
    assert kept[0].to_json()["ep"] == 4
    # with comms priced, the all-to-all per microbatch costs where FSDP's gathering per step did not
    calibration.comm["collectives"] = {op: {"step_latency_s": 1e-3, "step_bandwidth_bytes_per_s": 1e6}
                                       for op in ("all_reduce", "all_gather", "all_to_all")}
    kept, _, _ = tune(manifest, calibration, schedules=["1f1b"], microbatch_counts=[4], ep_sizes=[1, 2, 4])
    steps = {c.ep: c.step_s for c in kept}
    assert steps[1] != steps[2] != steps[4]


@pytest.mark.parametrize("layout,sizes,message", [
    (dict(dp=4), [3], r"--ep-sizes 3: an ep size must divide --dp 4 .* use ep sizes in \[1, 2, 4\]"),
    (dict(dp=4), [8], r"--ep-sizes 8: .*use ep sizes in \[1, 2, 4\]"),
    (dict(dp=4, experts=6), [4], r"--ep-sizes 4: .*the 6 routed experts of every block; use ep sizes in \[1, 2\]"),
    (dict(dp=4, mode="hsdp"), [2], r"--dp-mode hsdp already splits in two; use ep sizes in \[1\]"),
])
def test_ep_sizes_that_cannot_shard_are_refused_with_the_ones_that_can(layout, sizes, message):
    manifest = _ep_manifest(**layout)
    with pytest.raises(ValueError, match=message):
        tune(manifest, _tuning_calibration(manifest), schedules=["1f1b"], microbatch_counts=[4], ep_sizes=sizes)


def test_ep_sizes_need_the_routed_experts_in_the_segment_table():
    manifest = _manifest()
    manifest["plan"]["mesh"] = {"dp": 2, "pp": 2, "mode": "fsdp", "shard": None, "order": "pp-inner"}
    with pytest.raises(ValueError, match="records no routed experts"):
        tune(manifest, _tuning_calibration(manifest), schedules=["1f1b"], microbatch_counts=[4], ep_sizes=[1, 2])
    manifest = _ep_manifest()
    manifest["segments"][2]["ep"]["blocks"][0]["refused"] = "x (aten::gather) reads y, one row per pair"
    with pytest.raises(ValueError, match=r"blocks.2.experts cannot be sharded \(x \(aten::gather\)"):
        tune(manifest, _tuning_calibration(manifest), schedules=["1f1b"], microbatch_counts=[4], ep_sizes=[2])
    manifest = _ep_manifest()
    manifest["plan"]["mesh"]["ep"] = 2  # a folder split with --ep: priced as split, other sizes from its ep=1 split
    kept, _, _ = tune(manifest, _tuning_calibration(manifest), schedules=["1f1b"], microbatch_counts=[4])
    assert {c.ep for c in kept} == {2}
    with pytest.raises(ValueError, match="split with --ep 2; calibrate and tune its ep=1 split"):
        tune(manifest, _tuning_calibration(manifest), schedules=["1f1b"], microbatch_counts=[4], ep_sizes=[1, 2])


def test_segment_table_records_the_routed_experts_as_the_ep_plan_counts_them():
    """The tuner's figures per segment agree with the plan ``--ep 2`` makes of the same graph: the blocks, their
    (token, expert) pairs, the all-to-all bytes and the expert weights; dense layers and shared experts are not
    routed experts."""
    import os

    from tracepp.driver import check_model
    from tracepp.runtime.mesh import Layout
    from tracepp.tuner_figures import segments_with_figures

    zoo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo", "deepseek_v3.py")
    manifest = check_model(zoo, num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
    segments = segments_with_figures(zoo, tp_sizes=(), ep=True, num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
    figures = [seg["ep"] for seg in segments if "ep" in seg]
    blocks = [block for fig in figures for block in fig["blocks"]]
    assert [b["name"] for b in blocks] == [b["name"] for b in manifest["ep"]["blocks"]]
    for block, planned in zip(blocks, manifest["ep"]["blocks"]):
        assert (block["pairs"], block["experts"], block["refused"]) == (planned["pairs"], planned["experts"], "")
        moved = block["pairs"] * (block["row_bytes"] + block["out_row_bytes"]) * (2 - 1) // 2
        assert moved == planned["all_to_all_bytes"]["forward"]
    whole = {fqn: entry["shape"] for fqn, entry in manifest["ep"]["params"].items()}
    assert sum(fig["params"] for fig in figures) == sum(a * b * c for a, b, c in whole.values())
    assert sum(fig["param_bytes"] for fig in figures) == 4 * sum(a * b * c for a, b, c in whole.values())
    assert all(fig["flops"] > 0 for fig in figures)


def test_a_long_plan_prints_shortened():
    """A 405B plan has 64 stages: its checkpointing prints as runs and its cuts as the first, the last and a count
    (what `plan --apply` writes is the whole list)."""
    from tracepp.costs.search import _cuts_text, _runs_text

    assert _runs_text(["selective"] * 59 + ["none"] * 5) == "selective x59, none x5"
    assert _runs_text(["full", "none"]) == "full,none"
    cuts = [f"model.layers.{i}" for i in range(1, 126, 2)]
    assert _cuts_text(cuts) == "model.layers.1, model.layers.3 ... model.layers.125 (63 cuts)"
    assert _cuts_text(cuts[:2]) == "model.layers.1, model.layers.3"
