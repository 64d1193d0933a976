"""Expert parallelism: per-rank memory at ep 1, 2, 4 against the plan's own figures, and the all-to-all's price.

    python -m benchmarks.expert_parallel memory   [--out benchmarks/results]   # pp2 x dp4, ep 1 / 2 / 4: 8 processes
    python -m benchmarks.expert_parallel alltoall [--out benchmarks/results]   # the tuner's price vs gloo, 2 and 4 ranks

``memory`` splits the small Mixtral of ``benchmarks/mixtral_model.py`` (8 routed experts per layer, top-2, hidden
128, 8 layers, vocabulary 256; a batch of 8 x 64 tokens) with ``--ranks 2 --dp 4`` (FSDP2) and ``--ep`` 1, 2 and
4, 1F1B, 2 microbatches per replica, runs one AdamW step of each through ``benchmarks/ep_memory_worker.py`` (8
processes) and records every rank's bytes of the routed expert weights, their gradients and AdamW state, and of
the other parameters, each tensor's local shard as it sits in memory after the step; during the step, the expert
weights and gradients the stage modules held after each action (the most of any action), and the worst moment's
expert bytes (those, plus the shards and optimizer state kept beside them). Each figure is set against the
plan's: the manifest's per-rank stage estimate (``stage["estimate"]``: at rest, FSDP's shard and ep's experts)
and its placements (``manifest["placements"][fqn]["per_rank"]``), computed at split time from the graph and the
layout without running anything; and the tuner's worst-moment figure (``tracepp.costs.search.held_bytes``). Byte
counts are deterministic: one run, no medians, no times (8 processes on this machine's cores).

``alltoall`` checks the price ``plan --tune --ep-sizes`` puts on an all-to-all (``tracepp.costs.search.
all_to_all_s``: ep - 1 messages of 1/ep, from ranks 0 and 1's fitted all-to-all, as ``tracepp calibrate`` records
it) against gloo's own ``all_to_all_single`` of the same tensors over all ranks of a torchrun of 2 and 4 processes
(``benchmarks/ep_alltoall_worker.py``; ``--worlds 2,4,8`` for more). With 2 processes the price is the fit itself;
with more it extrapolates.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = os.path.join(HERE, "mixtral_model.py")
DP, PP = 4, 2
EP_SIZES = (1, 2, 4)
ADAMW_BYTES_PER_PARAM = 8


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)


def _run(command: list, env: dict) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result.stdout


def _torchrun(nproc: int, *args: str, env: dict) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
                env)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _planned(manifest: dict, experts: set, stage_index: int) -> dict:
    """What the plan says one rank of ``stage_index`` holds at rest: the stage estimate (all parameters) and the
    expert weights' bytes from the placements' per-rank shapes (fp32)."""
    stage = manifest["stages"][stage_index]
    fqns = [entry["fqn"] for entry in stage["state"] if entry["kind"] == "parameter"]
    expert_bytes = sum(4 * _numel(manifest["placements"][fqn]["per_rank"]) for fqn in fqns if fqn in experts)
    estimate = stage["estimate"]
    return {"estimate_param_bytes": estimate["param_bytes"], "estimate_grad_bytes": estimate["grad_bytes"],
            "estimate_optimizer_bytes": estimate["optimizer_bytes"], "placements_expert_param_bytes": expert_bytes,
            "whole_expert_param_bytes": sum(4 * _numel(e["shape"]) for e in stage["state"]
                                            if e["kind"] == "parameter" and e["fqn"] in experts)}


def memory(root: str) -> dict:
    from tracepp.costs.search import held_bytes
    from tracepp.runtime.mesh import Layout

    env = _env()
    folders = {}
    for ep in EP_SIZES:
        out = os.path.join(root, f"ep{ep}")
        _run([sys.executable, "-m", "tracepp", "split", MODEL, "-o", out, "--ranks", str(PP), "--dp", str(DP),
              "--schedule", "1f1b", "--microbatches", "2"] + (["--ep", str(ep)] if ep > 1 else []), env)
        folders[ep] = out
    manifests = {ep: json.load(open(os.path.join(folder, "manifest.json"))) for ep, folder in folders.items()}
    experts = set(manifests[max(EP_SIZES)]["ep"]["params"])
    runs = {}
    for ep, out in folders.items():
        result = os.path.join(root, f"memory_ep{ep}.json")
        start = time.perf_counter()
        _torchrun(DP * PP, "-m", "benchmarks.ep_memory_worker", out, "--experts-from", folders[max(EP_SIZES)],
                  "--json", result, env=env)
        wall = time.perf_counter() - start
        ranks = json.load(open(result))
        for rank in ranks:
            stage = rank["stages"][0]
            planned = _planned(manifests[ep], experts, stage)
            whole = planned["whole_expert_param_bytes"]
            count = whole // 4
            planned["tuner_worst_moment_expert_bytes"] = int(held_bytes(
                whole, count, Layout(pp=PP, dp=DP), True, ADAMW_BYTES_PER_PARAM, ep))
            rank["planned"] = planned
            rank["checks"] = {
                "param_bytes_equal_estimate": rank["expert_param_bytes"] + rank["other_param_bytes"]
                == planned["estimate_param_bytes"],
                "grad_bytes_equal_estimate": rank["expert_grad_bytes"] + rank["other_grad_bytes"]
                == planned["estimate_grad_bytes"],
                "optimizer_bytes_equal_estimate": rank["expert_optimizer_bytes"] + rank["other_optimizer_bytes"]
                == planned["estimate_optimizer_bytes"],
                "expert_param_bytes_equal_placements": rank["expert_param_bytes"]
                == planned["placements_expert_param_bytes"],
                "worst_moment_equal_tuner": rank["worst_moment_expert_bytes"]
                == planned["tuner_worst_moment_expert_bytes"]}
        runs[f"ep{ep}"] = {"ranks": ranks, "torchrun_wall_s": round(wall, 1)}
    summary = {}
    for key, run in runs.items():
        ranks = run["ranks"]
        whole = max(r["planned"]["whole_expert_param_bytes"] for r in ranks)
        entry = {}
        for what in ("param", "grad", "optimizer"):
            most = max(r[f"expert_{what}_bytes"] for r in ranks)
            scale = 2 if what == "optimizer" else 1  # AdamW: two fp32 tensors per parameter
            entry[f"expert_{what}_bytes_max_rank"] = most
            entry[f"expert_{what}_fraction_of_whole"] = round(most / (scale * whole), 4)
            entry[f"other_{what}_bytes_max_rank"] = max(r[f"other_{what}_bytes"] for r in ranks)
        entry["expert_state_bytes_max_rank"] = max(r["expert_param_bytes"] + r["expert_grad_bytes"]
                                                   + r["expert_optimizer_bytes"] for r in ranks)
        entry["in_step_expert_param_and_grad_bytes_max_rank"] = max(
            r["in_step_expert_param_bytes"] + r["in_step_expert_grad_bytes"] for r in ranks)
        entry["worst_moment_expert_bytes_max_rank"] = max(r["worst_moment_expert_bytes"] for r in ranks)
        entry["tuner_worst_moment_expert_bytes_max_rank"] = max(
            r["planned"]["tuner_worst_moment_expert_bytes"] for r in ranks)
        entry["whole_expert_param_bytes_per_stage"] = whole
        entry["all_checks_pass"] = all(all(r["checks"].values()) for r in ranks)
        entry["checks_failed"] = sorted({name for r in ranks for name, ok in r["checks"].items() if not ok})
        summary[key] = entry
    base = summary["ep1"]
    for key, entry in summary.items():
        entry["expert_state_ratio_to_ep1"] = round(entry["expert_state_bytes_max_rank"]
                                                   / base["expert_state_bytes_max_rank"], 4)
        entry["worst_moment_ratio_to_ep1"] = round(entry["worst_moment_expert_bytes_max_rank"]
                                                   / base["worst_moment_expert_bytes_max_rank"], 4)
    return {"model": "benchmarks/mixtral_model.py (8 experts top-2, hidden 128, intermediate 256, 8 layers, "
                     "vocabulary 256, batch 8 x 64)", "pp": PP, "dp": DP, "dp_mode": "fsdp", "schedule": "1f1b",
            "microbatches_per_replica": 2, "optimizer": "AdamW (fp32 exp_avg, exp_avg_sq)",
            "cores": os.cpu_count(), "expert_weights": len(experts), "summary": summary, "per_run": runs}


def alltoall(root: str, worlds=(2, 4)) -> dict:
    out = {"machine": platform.node(), "cores": os.cpu_count()}
    for world in worlds:
        result = os.path.join(root, f"alltoall_{world}.json")
        _torchrun(world, "-m", "benchmarks.ep_alltoall_worker", "--json", result, env=_env())
        out[f"ep{world}"] = json.load(open(result))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.expert_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["memory", "alltoall"])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--worlds", default="2,4", help="alltoall: the process counts to measure (default 2,4)")
    parser.add_argument("--name", default="", help="a suffix for the result file's name")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        run = memory(root) if args.what == "memory" else alltoall(root, [int(w) for w in args.worlds.split(",")])
        record = {"what": args.what, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **run}
    print(json.dumps({k: v for k, v in record.items() if k != "per_run"}, indent=1))
    write_result(args.out, f"expert_parallel_{args.what}{args.name}", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
