"""Planning mixture-of-experts models: every stage's FLOPs counted, and the cut balanced by them.

    python -m benchmarks.moe_plan plan [--out benchmarks/results]      # DeepSeek-V3 at full size (671B), on meta
    python -m benchmarks.moe_plan mixtral [--out benchmarks/results]   # a small Mixtral: predicted vs measured step

``plan`` splits ``benchmarks/deepseek_v3_shape.py`` (61 layers, the first 3 dense, 256 routed experts top-8,
MLA, vocabulary 129,280) into 32 stages on 16 ranks, interleaved 1F1B, 16 microbatches of 1 x 4096 tokens, with
no split option but the counts (the automatic balancer cuts between ``model.layers.N``), and records the wall
time and peak RSS of the ``tracepp split`` process (``os.wait4``), the lines it wrote to stderr, every stage's
forward FLOPs and parameters, and max / mean. ``mixtral`` splits a small Mixtral (8 experts, top-2, hidden 128,
8 layers; ``benchmarks/mixtral_model.py``) on 2 ranks with 1F1B, calibrates the folder without fitting anything
to its own run (``tracepp calibrate --no-fit``: ping-pong, stage costs, runtime factors), takes the per-action
overhead fitted on the example GPT's folder, and sets the predicted step against the median of a separate
measured run; then, as a user would, calibrates the folder with its default fit (the per-action overhead fitted
to its own calibration run, before and apart from the measured run) and predicts again (``error_own_fit_pct``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def plan(root: str) -> dict:
    out = os.path.join(root, "deepseek_v3")
    command = [sys.executable, "-m", "tracepp", "split", os.path.join(HERE, "deepseek_v3_shape.py"), "-o", out,
               "--ranks", "16", "--stages", "32", "--schedule", "interleaved-1f1b", "--microbatches", "16"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=REPO))
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-4000:]}")
    import resource

    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    flops = [stage["forward_flops"] for stage in manifest["stages"]]
    mean = sum(flops) / len(flops)
    return {"case": "DeepSeek-V3 671B shape, 32 stages / 16 ranks, interleaved-1f1b, 16 microbatches of 1 x 4096",
            "wall_s": round(wall, 1), "peak_rss_gb": round(peak_gb, 2), "stderr_lines": len(stderr.splitlines()),
            "stderr": stderr.splitlines()[:20],
            "parameters": sum(s["num_params"] for s in manifest["stages"]),
            "stage_forward_tflop_per_microbatch": [round(f / 1e12, 3) for f in flops],
            "stage_params_b": [round(s["num_params"] / 1e9, 2) for s in manifest["stages"]],
            "stage_modules": [s["module_fqns"][:1] + s["module_fqns"][-1:] for s in manifest["stages"]],
            "max_over_mean_flops": round(max(flops) / mean, 3), "min_over_mean_flops": round(min(flops) / mean, 3),
            "flop_count": manifest["flop_count"]}


def _run_steps(out: str, steps: int, warmup: int, env: dict, metrics: str) -> float:
    """The median step (s) of a separate measured run of the folder (warm-up steps dropped)."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    os.path.join(out, "run.py"), "--steps", str(steps), "--metrics", metrics, "--quiet"],
                   check=True, env=env, capture_output=True)
    times = sorted(json.loads(line)["step_time_s"] for line in open(metrics).readlines()[warmup:])
    return times[len(times) // 2]


def mixtral(root: str, steps: int = 24, warmup: int = 4) -> dict:
    """Predicted against measured, with nothing fitted to the Mixtral folder: its own stage costs, comms and
    runtime factors (``calibrate --no-fit``), and the per-action overhead fitted on another model's folder (the
    example GPT, ``calibrate`` with its default fit), as the suite predicts each case from the others' fits."""
    from tracepp.codegen.manifest import load_manifest
    from tracepp.costs.model import CALIBRATION_FILE, load_calibration, predict_folder

    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    tracepp = [sys.executable, "-m", "tracepp"]
    gpt, out = os.path.join(root, "gpt"), os.path.join(root, "mixtral")
    subprocess.run(tracepp + ["split", os.path.join(REPO, "examples", "gpt.py"), "-o", gpt, "--ranks", "2",
                              "--schedule", "1f1b", "--microbatches", "4"], check=True, env=env, capture_output=True)
    subprocess.run(tracepp + ["calibrate", gpt], check=True, env=env, capture_output=True)
    subprocess.run(tracepp + ["split", os.path.join(HERE, "mixtral_model.py"), "-o", out, "--ranks", "2",
                              "--schedule", "1f1b", "--microbatches", "4"], check=True, env=env, capture_output=True)
    subprocess.run(tracepp + ["calibrate", out, "--no-fit"], check=True, env=env, capture_output=True)
    own = json.load(open(os.path.join(out, CALIBRATION_FILE)))
    other = json.load(open(os.path.join(gpt, CALIBRATION_FILE)))
    manifest = load_manifest(out)
    unfitted = predict_folder(manifest, load_calibration(out)).step_s
    own["overhead"] = dict(other["overhead"], source="fitted on the example GPT's folder (another model)")
    with open(os.path.join(out, CALIBRATION_FILE), "w") as handle:
        json.dump(own, handle)
    predicted = predict_folder(manifest, load_calibration(out)).step_s
    # the user's workflow: `tracepp calibrate` on this folder, its overhead fitted to its own calibration run
    # (a run before, and apart from, the measured one below)
    subprocess.run(tracepp + ["calibrate", out], check=True, env=env, capture_output=True)
    own_fit = load_calibration(out)
    predicted_own = predict_folder(manifest, own_fit).step_s
    measured = _run_steps(out, steps, warmup, env, os.path.join(root, "mixtral_metrics.jsonl"))
    return {"case": "small Mixtral (8 experts, top-2, hidden 128, 8 layers), 2 ranks, 1F1B, 4 microbatches",
            "stage_forward_mflop_per_microbatch": [round(s["forward_flops"] / 1e6, 2) for s in manifest["stages"]],
            "overhead_from_gpt_s_per_action": other["overhead"].get("compute_action_s"),
            "predicted_s": predicted, "predicted_without_overhead_s": unfitted, "measured_median_s": measured,
            "error_pct": round(100 * (predicted - measured) / measured, 1),
            "error_without_overhead_pct": round(100 * (unfitted - measured) / measured, 1),
            "overhead_own_fit_s_per_action": own_fit.overhead.get("compute_action_s"),
            "calibration_noise": own_fit.noise, "predicted_own_fit_s": predicted_own,
            "error_own_fit_pct": round(100 * (predicted_own - measured) / measured, 1),
            "measured_steps": steps - warmup}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_plan", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["plan", "mixtral"])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        result = plan(root) if args.what == "plan" else mixtral(root)
    print(json.dumps({k: v for k, v in result.items() if k != "stderr"}, indent=1))
    write_result(args.out, f"moe_{args.what}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
