"""Planning mixture-of-experts models: every stage's FLOPs counted, and the cut balanced by them.

    python -m benchmarks.moe_plan plan [--out benchmarks/results]      # DeepSeek-V3 at full size (671B), on meta
    python -m benchmarks.moe_plan plan --dp 32 --ep 32                 # the same x 32 replicas, experts over 32
    python -m benchmarks.moe_plan mixtral [--out benchmarks/results]   # a small Mixtral: predicted vs measured step

``plan`` splits ``benchmarks/deepseek_v3_shape.py`` (61 layers, the first 3 dense, 256 routed experts top-8,
MLA, vocabulary 129,280) into 32 stages on 16 ranks, interleaved 1F1B, 16 microbatches of 1 x 4096 tokens, with
no split option but the counts (the automatic balancer cuts between ``model.layers.N``), and records the wall
time and peak RSS of the ``tracepp split`` process (``os.wait4``), the lines it wrote to stderr, every stage's
forward FLOPs and parameters, and max / mean. With ``--dp N [--ep E]`` the global batch is N x 16 samples
(``DEEPSEEK_V3_BATCH``: 512 at dp 32, so each replica still runs 16 microbatches of 1 x 4096 tokens) and the record
adds whether every routed expert weight (every ``.mlp.experts.`` parameter) is sharded over ep, the experts one
rank holds, the (token, expert) pairs and all-to-all bytes per microbatch of a block, and each rank's memory from
the per-rank stage estimates (parameters, gradients and Adam state as one rank holds them after a step, FSDP's
1/dp of the rest; activations of the microbatches in flight), min / max over the stages. ``mixtral`` splits a small Mixtral (8 experts, top-2, hidden 128,
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


def plan(root: str, dp: int = 1, ep: int = 1) -> dict:
    out = os.path.join(root, "deepseek_v3")
    command = [sys.executable, "-m", "tracepp", "split", os.path.join(HERE, "deepseek_v3_shape.py"), "-o", out,
               "--ranks", "16", "--stages", "32", "--schedule", "interleaved-1f1b", "--microbatches", "16"]
    env = dict(os.environ, PYTHONPATH=REPO)
    if dp > 1:
        command += ["--dp", str(dp)] + (["--ep", str(ep)] if ep > 1 else [])
        env["DEEPSEEK_V3_BATCH"] = str(16 * dp)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-4000:]}")
    import resource

    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    flops = [stage["forward_flops"] for stage in manifest["stages"]]
    mean = sum(flops) / len(flops)
    case = "DeepSeek-V3 671B shape, 32 stages / 16 ranks, interleaved-1f1b, 16 microbatches of 1 x 4096"
    extra = {}
    if dp > 1:
        case += f", --dp {dp}" + (f" --ep {ep}" if ep > 1 else "") + f" (global batch {16 * dp})"
        extra = _per_rank(manifest)
    return {"case": case, "command": " ".join(command[3:]), "dp": dp, "ep": ep, **extra,
            "wall_s": round(wall, 1), "peak_rss_gb": round(peak_gb, 2), "stderr_lines": len(stderr.splitlines()),
            "stderr": stderr.splitlines()[:20],
            "parameters": sum(s["num_params"] for s in manifest["stages"]),
            "stage_forward_tflop_per_microbatch": [round(f / 1e12, 3) for f in flops],
            "stage_params_b": [round(s["num_params"] / 1e9, 2) for s in manifest["stages"]],
            "stage_modules": [s["module_fqns"][:1] + s["module_fqns"][-1:] for s in manifest["stages"]],
            "max_over_mean_flops": round(max(flops) / mean, 3), "min_over_mean_flops": round(min(flops) / mean, 3),
            "flop_count": manifest["flop_count"]}


def _per_rank(manifest: dict) -> dict:
    """Expert parallelism and each rank's memory, read from the manifest: every routed expert weight sharded, the
    experts a rank holds, a block's pairs and all-to-all bytes per microbatch, the per-rank stage estimates."""
    ep = manifest.get("ep") or {}
    routed = sorted({entry["fqn"] for stage in manifest["stages"] for entry in stage["state"]
                     if entry["kind"] == "parameter" and ".mlp.experts." in entry["fqn"]})
    sharded = set(ep.get("params", {}))
    estimates = [stage["estimate"] for stage in manifest["stages"]]
    gb = 1e9

    def spread(key) -> list:
        values = [key(e) if callable(key) else e[key] for e in estimates]
        return [round(min(values) / gb, 2), round(max(values) / gb, 2)]

    first = (ep.get("blocks") or [{}])[0]
    example = next(iter(sorted(sharded)), None)
    return {"routed_expert_weights": len(routed), "routed_expert_weights_sharded": len(set(routed) & sharded),
            "every_routed_expert_weight_sharded": bool(routed) and set(routed) <= sharded,
            "expert_blocks": len(ep.get("blocks", [])),
            "example_expert_weight": {"fqn": example, **ep["params"][example]} if example else None,
            "block_experts_per_rank": f"{first.get('local_experts')} of {first.get('experts')}",
            "block_pairs_per_microbatch": first.get("pairs"), "block_all_to_all_bytes": first.get("all_to_all_bytes"),
            "estimates_per_rank": all(e.get("per_rank") for e in estimates),
            "rank_memory_gb_min_max": spread("memory_bytes"), "rank_param_gb_min_max": spread("param_bytes"),
            "rank_optimizer_gb_min_max": spread("optimizer_bytes"),
            "rank_state_gb_min_max": spread(lambda e: e["param_bytes"] + e["grad_bytes"] + e["optimizer_bytes"]),
            "rank_activation_gb_min_max": spread("activation_bytes"),
            "rank_activation_gb_per_microbatch_min_max": spread("activation_bytes_per_microbatch"),
            "inflight_microbatches_min_max": [min(e["inflight_microbatches"] for e in estimates),
                                              max(e["inflight_microbatches"] for e in estimates)],
            "rank_memory_gb_per_stage": [round(e["memory_bytes"] / gb, 2) for e in estimates]}


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
    parser.add_argument("--dp", type=int, default=1, help="plan: data-parallel replicas (global batch 16 x dp)")
    parser.add_argument("--ep", type=int, default=1, help="plan: expert-parallel ranks, carved from --dp")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        result = plan(root, args.dp, args.ep) if args.what == "plan" else mixtral(root)
    print(json.dumps({k: v for k, v in result.items() if k not in ("stderr", "flop_count")}, indent=1))
    suffix = (f"_dp{args.dp}" + (f"_ep{args.ep}" if args.ep > 1 else "")) if args.what == "plan" and args.dp > 1 else ""
    write_result(args.out, f"moe_{args.what}{suffix}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
