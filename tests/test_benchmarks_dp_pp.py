"""The DP x PP benchmark end to end on one tiny case (harness correctness only: no time is ever asserted).

2 pipeline ranks x 2 replicas (4 processes on gloo), 1F1B, 2 microbatches per replica, one round of a few steps:
tracepp's ``--dp 2 --dp-mode fsdp`` and the hand-built torch job (pipelining + fully_shard) both run, the JSON
holds both with step times, memory for all four ranks, and the trained parameters agree.
"""
import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_dp_pp_writes_both_systems(tmp_path):
    out = str(tmp_path / "results")
    command = [sys.executable, "-m", "benchmarks.dp_pp", "--tiny", "--rounds", "1", "--warmup", "1", "--steps", "2",
               "--timeout", "60", "--run-timeout", "150", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=330, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "problems:" not in result.stdout, result.stdout
    for header in ("step ms", "tokens/s", "vs torch", "peak MB rank 0/1/2/3", "max |param diff|"):
        assert header in result.stdout
    files = glob.glob(os.path.join(out, "*_cpu_dp_pp.json"))
    assert len(files) == 1, os.listdir(out)
    report = json.load(open(files[0]))
    assert report["systems"] == ["tracepp", "torch"] and report["dp_mode"] == "fsdp"
    assert report["loadavg_start"] and "CPU allocator" in report["memory_method"]
    (entry,) = report["results"]
    assert (entry["pp"], entry["dp"], entry["processes"], entry["schedule"]) == (2, 2, 4, "1f1b")
    for system in ("tracepp", "torch"):
        part = entry[system]
        assert part["status"] == "ok", part
        assert part["measured_steps"] == 2 and part["step_time_s"] > 0 and part["tokens_per_s"] > 0
        assert len(part["peak_mem_mb_per_rank"]) == 4  # every rank of the mesh measured
        assert all(m > 0 for m in part["peak_mem_mb_per_rank"])
        assert len(part["range_s"]) == 2
        # both reduce gradients once per step: one reduce-scatter and one all-gather per rank (counted, not timed)
        for ops in part["comm_ops_per_rank"]:
            assert [v for k, v in ops.items() if "reduce_scatter" in k] == [1], ops
            assert [v for k, v in ops.items() if "allgather" in k] == [1], ops
    assert isinstance(entry["ratio_tracepp_over_torch"], float) and entry["ratio_tracepp_over_torch"] > 0
    check = entry["validation"]["torch"]
    assert check["same_losses"] is True, check  # same model, split, schedule, slices, loss and SGD
    assert check["max_abs_diff"] < 1e-5, check


def test_tiny_dp_pp_bf16_gathers_what_fsdp_with_the_same_policy_gathers(tmp_path):
    """``--precision bf16``: tracepp against torch's hand-built stages wrapped with the same
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the same trained parameters (the same recipe,
    bit for bit), and per rank the same bytes all-gathered (bf16: half the bytes its fp32 reduce-scatter carries)."""
    out = str(tmp_path / "results")
    command = [sys.executable, "-m", "benchmarks.dp_pp", "--tiny", "--precision", "bf16", "--rounds", "1",
               "--warmup", "1", "--steps", "2", "--timeout", "60", "--run-timeout", "150", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=330, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "vs torch-manual" in result.stdout
    (path,) = glob.glob(os.path.join(out, "*_cpu_dp_pp_bf16.json"))
    report = json.load(open(path))
    assert report["systems"] == ["tracepp", "torch-manual"] and report["precision"] == "bf16"
    (entry,) = report["results"]
    check = entry["validation"]["torch-manual"]
    assert check["same_losses"] is True and check["max_abs_diff"] == 0.0, check
    mine, theirs = entry["tracepp"]["comm_bytes_per_rank"], entry["torch-manual"]["comm_bytes_per_rank"]
    for ours, torchs in zip(mine, theirs):
        gathered = [v for k, v in ours.items() if "allgather" in k]
        scattered = [v for k, v in ours.items() if "reduce_scatter" in k]
        assert gathered == [v for k, v in torchs.items() if "allgather" in k]
        assert gathered[0] * 2 == scattered[0]  # the same parameters: gathered in bf16, reduced in fp32
