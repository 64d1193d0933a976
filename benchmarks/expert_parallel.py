"""Expert parallelism: per-rank memory at ep 1, 2, 4 against the plan's own figures, and the all-to-all's price.

    python -m benchmarks.expert_parallel memory   [--out benchmarks/results]   # pp2 x dp4, ep 1 / 2 / 4: 8 processes
    python -m benchmarks.expert_parallel alltoall [--out benchmarks/results]   # the tuner's price vs gloo, 2 and 4 ranks
    python -m benchmarks.expert_parallel step [--rounds 3]                     # dp2 x ep2 step vs torchtitan's all-to-all

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

``step`` times tracepp's expert parallelism against an all-to-all expert layer as torchtitan writes it
(``benchmarks/ep_torch_worker.py``, ``benchmarks/ep_alltoall_moe.py``: torchtitan's own ``AllToAllTokenDispatcher``
where torchtitan imports, else the same steps rewritten; grouped matmuls on local experts; FSDP2 over dp for the
rest) on the same small Mixtral (``benchmarks/mixtral_model.py``), dp2 x ep2 on 2 processes, each rank a replica
with half the batch (4 x 64 tokens) and half the experts: tracepp ``--ranks 1 --dp 2 --ep 2 --microbatches 1``
with ``--on-nonfinite continue``. Paired rounds as ``benchmarks.tensor_parallel step`` (``benchmarks/paired.py``);
both systems' parameters after the last step are held against each other and against eager training of the
unsplit model on the global batch (asserted within ``--tolerance``). Where torchtitan imports, the rewrite is run
once too and its parameters held against torchtitan's dispatcher's. The peer's grouped matmuls are
``torch._grouped_mm`` (``--grouped-mm torch``: torchtitan's, and what eager Hugging Face runs on CPU); tracepp's
rank scripts call the kernel the traced Mixtral calls, transformers' per-expert loop (``torch.export`` counts as
compiling, and transformers falls back for fp32 there): ``--grouped-mm fallback`` gives the peer the same kernel.
Every run ends with the two untimed steps of ``benchmarks/memory.py`` (peak memory per rank, ``c10d`` ops).
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


def step(root: str, rounds: int, warmup: int, steps: int, tolerance: float, dispatcher: str,
         grouped_mm: str = "torch", extra_args: tuple = ()) -> dict:
    from benchmarks import paired

    from benchmarks.memory import MEMORY_STEPS, read_memory

    environment = paired.env()
    total = warmup + steps + MEMORY_STEPS  # the last two: the memory window, untimed
    eager = paired.eager_train(MODEL, total)
    folder = os.path.join(root, "dp2_ep2")
    options = ["--ranks", "1", "--dp", "2", "--ep", "2", "--microbatches", "1"]
    _run([sys.executable, "-m", "tracepp", "split", MODEL, "-o", folder, *options], environment)

    def tracepp_run(round_index):
        metrics, save, memory = (os.path.join(root, f"tracepp_{round_index}{x}") for x in (".jsonl", ".pt", "_mem"))
        result = paired.run_logged(paired.torchrun(2, "-m", "benchmarks.tracepp_worker", folder, "--memory-dir", memory,
                                                   "--", "--steps", str(total), "--metrics", metrics, "--quiet",
                                                   "--on-nonfinite", "continue", "--save", save),
                                   metrics + ".log", environment, 900)
        result["measured"] = paired.measured(paired.read_metrics(metrics), warmup, steps)
        result.update(save=save, memory=read_memory(memory))
        return result

    def torch_run(round_index, kind=dispatcher, count=total, tag="torch"):
        metrics, save, memory = (os.path.join(root, f"{tag}_{round_index}{x}") for x in (".jsonl", ".pt", "_mem"))
        result = paired.run_logged(paired.torchrun(2, "-m", "benchmarks.ep_torch_worker", "--model-file", MODEL,
                                                   "--dispatcher", kind, "--grouped-mm", grouped_mm, "--steps",
                                                   str(count), "--metrics", metrics, "--save", save, "--memory-dir",
                                                   memory), metrics + ".log", environment, 900)
        lines = paired.read_metrics(metrics)
        result["measured"] = paired.measured(lines, warmup, steps)
        result["dispatcher"] = lines[0].get("dispatcher") if lines else None
        result.update(save=save, memory=read_memory(memory))
        return result

    runs = paired.run_rounds({"tracepp": tracepp_run, "torch": torch_run}, rounds)
    summary = paired.summarize(runs)
    ours, theirs = torch.load(runs["tracepp"][0]["save"]), torch.load(runs["torch"][0]["save"])
    between, where = paired.max_difference(ours, theirs)
    to_eager = {name: paired.max_difference(torch.load(runs[name][0]["save"]), eager) for name in runs}
    used = runs["torch"][0]["dispatcher"]
    rewrite_check = None
    if used == "torchtitan":  # the rewrite (for machines without torchtitan) against torchtitan's own dispatcher
        check = torch_run(0, "rewrite", total, "rewrite")
        if not check["ok"]:
            raise RuntimeError(f"the rewritten dispatcher failed: {check['error']}")
        rewrite_check = paired.max_difference(torch.load(check["save"]), theirs)[0]
    if between > tolerance or any(value[0] > tolerance for value in to_eager.values()):
        raise AssertionError(f"parameters differ beyond {tolerance}: tracepp vs torch {between:.3g} ({where}); "
                             f"against eager {to_eager}")
    return {"model": "benchmarks/mixtral_model.py (8 experts top-2, hidden 128, intermediate 256, 8 layers, "
                     "vocabulary 256, batch 8 x 64)", "processes": 2, "dp": 2, "ep": 2, "rounds": rounds,
            "warmup_steps": warmup, "measured_steps": steps, "tolerance": tolerance,
            "tracepp_options": options + ["run.py --on-nonfinite continue", *extra_args],
            "torch": f"benchmarks/ep_torch_worker.py: FSDP2 over dp, experts over ep by all_to_all_single, "
                     f"dispatcher: {used}", "dispatcher": used,
            "max_abs_diff_rewrite_vs_torchtitan_dispatcher": rewrite_check, "systems": summary,
            **paired.ratios(summary, "tracepp", "torch"), "max_abs_diff_tracepp_torch": between,
            "worst_parameter": where, "max_abs_diff_to_eager": {name: value[0] for name, value in to_eager.items()},
            "losses": {name: [line["loss"] for line in runs[name][0]["measured"]] for name in runs},
            "peer_grouped_mm": grouped_mm,
            "peak_memory_mb_per_rank": {name: [m.get("peak_mb") for m in runs[name][0]["memory"]] for name in runs},
            "comm_ops_per_step_rank0": {name: (runs[name][0]["memory"] or [{}])[0].get("comm_ops") for name in runs}}


def _step_table(record: dict) -> str:
    from tabulate import tabulate

    a, b = record["systems"]["tracepp"], record["systems"]["torch"]
    return tabulate([["dp2_ep2", 2, f"{a['step_s'] * 1000:.1f}", f"{b['step_s'] * 1000:.1f}",
                      f"{record['ratio_paired']:.3f}", f"{a['cpu_s'] * 1000:.1f}", f"{b['cpu_s'] * 1000:.1f}",
                      f"{record['cpu_ratio_paired']:.3f}", f"{record['max_abs_diff_tracepp_torch']:.2g}",
                      f"{max(record['peak_memory_mb_per_rank']['tracepp'] or [0]):.1f} / "
                      f"{max(record['peak_memory_mb_per_rank']['torch'] or [0]):.1f}",
                      f"{record['dispatcher']}, {record['peer_grouped_mm']}"]],
                    headers=["case", "procs", "tracepp ms", "torch ms", "tracepp/torch (paired)", "tracepp cpu ms",
                             "torch cpu ms", "cpu ratio", "max |diff|", "peak MB tracepp / torch",
                             "peer's dispatcher, grouped mm"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.expert_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["memory", "alltoall", "step"])
    parser.add_argument("--rounds", type=int, default=3, help="step: paired rounds")
    parser.add_argument("--warmup", type=int, default=3, help="step: warm-up steps dropped per run")
    parser.add_argument("--steps", type=int, default=10, help="step: measured steps per run")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="step: largest parameter difference allowed")
    parser.add_argument("--dispatcher", default="auto", choices=["auto", "torchtitan", "rewrite"],
                        help="step: the peer's token dispatcher (auto: torchtitan's where it imports)")
    parser.add_argument("--grouped-mm", default="torch", choices=["torch", "fallback"],
                        help="step: the peer's grouped matmul (torch: torch._grouped_mm, torchtitan's; fallback: "
                             "transformers' per-expert loop, the kernel tracepp's traced Mixtral calls)")
    parser.add_argument("--tracepp-args", default="", help="step: more flags for tracepp's run.py (e.g. '--cpu-bind none')")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--worlds", default="2,4", help="alltoall: the process counts to measure (default 2,4)")
    parser.add_argument("--name", default="", help="a suffix for the result file's name")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        if args.what == "step":
            run = step(root, args.rounds, args.warmup, args.steps, args.tolerance, args.dispatcher, args.grouped_mm,
                       tuple(args.tracepp_args.split()))
        else:
            run = memory(root) if args.what == "memory" else alltoall(root, [int(w) for w in args.worlds.split(",")])
        record = {"what": args.what, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "cores": os.cpu_count(), **run}
    if args.what == "step":
        print(_step_table(record))
    else:
        print(json.dumps({k: v for k, v in record.items() if k != "per_run"}, indent=1))
    write_result(args.out, f"expert_parallel_{args.what}{args.name}", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
