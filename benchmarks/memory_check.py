"""Memory you can plan on, checked: each rank's peak predicted at split time against the peak its run measures.

    python -m benchmarks.memory_check [--cases NAME,...] [--out benchmarks/results]

Every case splits ``tests/models/memory_zoo.py`` (``MEMORY_FAMILY``: Llama, GPT-2, Mixtral, DeepSeek-V3 at hidden
64, 4 layers, 32 tokens a sample; Granite, GLM, Helium, Seed-OSS and OLMoE, families no other test names, at hidden
256 and 256 tokens, where a microbatch's activations outweigh a stage's weights) with its layout and run options,
trains 2 steps under torchrun on gloo with ``run.py --measure-memory`` (torch's own MemTracker on CPU, its device
total from the first step to the last: a meter that shares no code with the plan's count), and records per rank:
the predicted peak (``manifest["memory"]["ranks"]``) and the measured one, their ratio, where each happened, and
per stage what its forwards left alive (what autograd keeps for backward: the storages the tracker saw a forward
make that are still alive after it, the least over the stage's forwards) against the counted ``kept`` bytes. The matrix: the nine families; fp32 and
bf16; activation checkpointing none, full, selective and every-2; GPipe, 1F1B, interleaved 1F1B and zero-bubble;
FSDP, DDP, ``--tp 2 --sequence-parallel``, ``--cp 2`` and ``--cp 4`` (with tp 2 + SP, with dp 2) and
``--dp 2 --ep 2``; SGD and AdamW. Byte counts are deterministic on a given torch: one run each, no medians. The
test suite runs seven of these cases (tests/test_e2e_memory.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = os.path.join(REPO, "tests", "models", "memory_zoo.py")
TOLERANCE = 0.10
MID = {"MEMORY_HIDDEN": "256", "MEMORY_SEQ": "256"}  # the model file's sizes (default: hidden 64, 32 tokens)
SIZES = ("MEMORY_HIDDEN", "MEMORY_SEQ", "MEMORY_VOCAB")


def case_env(case: tuple) -> dict:
    """The environment the model file reads for a case: its family and sizes (the defaults' variables unset)."""
    return {"MEMORY_FAMILY": case[0], **(case[5] if len(case) > 5 else {})}


def set_case_env(case: tuple) -> dict:
    """Put a case's environment into this process (the split reads it; the split cache keys on it)."""
    env = case_env(case)
    for name in SIZES:
        os.environ.pop(name, None)
    os.environ.update(env)
    return env


def _cases():
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions as Run

    pp2 = Layout(pp=2)
    return {  # name: (family, world, split options, layout, run options[, model sizes])
        "llama-1f1b-fp32-none": ("llama", 2, dict(schedule="1f1b", num_microbatches=4), pp2, Run()),
        "llama-gpipe-bf16-full-adamw": ("llama", 2, dict(schedule="gpipe", num_microbatches=4), pp2,
                                        Run(precision="bf16", activation_checkpointing="full", optimizer="adamw")),
        "llama-1f1b-fp32-every-2": ("llama", 2, dict(schedule="1f1b", num_microbatches=4), pp2,
                                    Run(activation_checkpointing="every-2")),
        "gpt2-interleaved-bf16-selective": ("gpt2", 2, dict(schedule="interleaved-1f1b", num_stages=4,
                                                            num_microbatches=4), pp2,
                                            Run(precision="bf16", activation_checkpointing="selective")),
        "gpt2-interleaved-zero-bubble-fp32-selective": ("gpt2", 2, dict(schedule="interleaved-zb", num_stages=4,
                                                                        num_microbatches=4), pp2,
                                                        Run(activation_checkpointing="selective")),
        "gpt2-zbv-bf16-none-adamw": ("gpt2", 2, dict(schedule="zbv", num_stages=4, num_microbatches=4), pp2,
                                     Run(precision="bf16", optimizer="adamw")),
        "mixtral-1f1b-bf16-selective": ("mixtral", 2, dict(schedule="1f1b", num_microbatches=2), pp2,
                                        Run(precision="bf16", activation_checkpointing="selective")),
        "mixtral-gpipe-fp32-full": ("mixtral", 2, dict(schedule="gpipe", num_microbatches=4), pp2,
                                    Run(activation_checkpointing="full")),
        "deepseek_v3-1f1b-fp32-none": ("deepseek_v3", 2, dict(schedule="1f1b", num_microbatches=4), pp2, Run()),
        "deepseek_v3-interleaved-bf16-selective-adamw": ("deepseek_v3", 2, dict(schedule="interleaved-1f1b",
                                                                                num_stages=4, num_microbatches=4),
                                                         pp2, Run(precision="bf16", activation_checkpointing="selective",
                                                                  optimizer="adamw")),
        "llama-fsdp-dp2-interleaved-fp32-adamw": ("llama", 4, dict(schedule="interleaved-1f1b", num_stages=4,
                                                                   num_microbatches=2), Layout(pp=2, dp=2),
                                                  Run(optimizer="adamw")),
        "llama-fsdp-dp2-1f1b-bf16-adamw": ("llama", 4, dict(schedule="1f1b", num_microbatches=2), Layout(pp=2, dp=2),
                                           Run(precision="bf16", optimizer="adamw")),
        "gpt2-ddp-dp2-1f1b-bf16-full": ("gpt2", 4, dict(schedule="1f1b", num_microbatches=2),
                                        Layout(pp=2, dp=2, dp_mode="ddp"),
                                        Run(precision="bf16", activation_checkpointing="full")),
        "llama-tp2-sequence-parallel-1f1b-bf16-selective": ("llama", 4, dict(schedule="1f1b", num_microbatches=2),
                                                            Layout(pp=2, tp=2, sequence_parallel=True),
                                                            Run(precision="bf16", activation_checkpointing="selective")),
        "llama-tp2-1f1b-fp32-full": ("llama", 4, dict(schedule="1f1b", num_microbatches=2), Layout(pp=2, tp=2),
                                     Run(activation_checkpointing="full")),
        "mixtral-dp2-ep2-1f1b-fp32": ("mixtral", 4, dict(schedule="1f1b", num_microbatches=2),
                                      Layout(pp=2, dp=2, ep=2), Run()),
        "deepseek_v3-dp2-ep2-1f1b-bf16-full": ("deepseek_v3", 4, dict(schedule="1f1b", num_microbatches=2),
                                               Layout(pp=2, dp=2, ep=2),
                                               Run(precision="bf16", activation_checkpointing="full")),
        "llama-cp2-1f1b-adamw": ("llama", 4, dict(schedule="1f1b", num_microbatches=4), Layout(pp=2, cp=2),
                                 Run(optimizer="adamw")),
        # families no other test names, at a size where activations weigh (hidden 256, 256 tokens a sample)
        "granite-1f1b-bf16-selective-adamw": ("granite", 2, dict(schedule="1f1b", num_microbatches=4), pp2,
                                              Run(precision="bf16", activation_checkpointing="selective",
                                                  optimizer="adamw"),
                                              MID),
        "helium-cp2-1f1b-adamw": ("helium", 4, dict(schedule="1f1b", num_microbatches=4), Layout(pp=2, cp=2),
                                  Run(optimizer="adamw"), MID),
        "helium-cp4-1f1b-adamw": ("helium", 8, dict(schedule="1f1b", num_microbatches=4), Layout(pp=2, cp=4),
                                  Run(optimizer="adamw"), MID),
        "helium-cp2-tp2-sequence-parallel-1f1b-adamw": ("helium", 8, dict(schedule="1f1b", num_microbatches=4),
                                                        Layout(pp=2, cp=2, tp=2, sequence_parallel=True),
                                                        Run(optimizer="adamw"), MID),
        "helium-cp2-fsdp-dp2-1f1b-adamw": ("helium", 8, dict(schedule="1f1b", num_microbatches=2),
                                           Layout(pp=2, cp=2, dp=2), Run(optimizer="adamw"), MID),
        "glm-tp2-sequence-parallel-1f1b-bf16-selective": ("glm", 4, dict(schedule="1f1b", num_microbatches=4),
                                                          Layout(pp=2, tp=2, sequence_parallel=True),
                                                          Run(precision="bf16",
                                                              activation_checkpointing="selective"), MID),
        "seed_oss-fsdp-dp2-interleaved-adamw": ("seed_oss", 4, dict(schedule="interleaved-1f1b", num_stages=4,
                                                                    num_microbatches=2), Layout(pp=2, dp=2),
                                                Run(optimizer="adamw"), MID),
        "olmoe-dp2-ep2-1f1b-bf16": ("olmoe", 4, dict(schedule="1f1b", num_microbatches=2), Layout(pp=2, dp=2, ep=2),
                                    Run(precision="bf16"), MID),
    }


def forward_kept(measured: dict, manifest: dict) -> list:
    """[(stage, measured, predicted)]: the least of what each forward of a stage made and left alive in the run's
    last step (a wrapped stage's first forward of a step also gathers its parameters under FSDP or DDP, or casts their
    compute copy under ``--mixed-precision params``: left out; a forward during which an earlier collective's buffer
    is made and outlives it leaves that too, which the least leaves out), against the stage's counted ``kept`` bytes
    per microbatch."""
    from tracepp.runtime.actions import Action

    stages = manifest["memory"]["stages"]
    mesh = manifest["plan"].get("mesh") or {}
    # FSDP/DDP over dp (or dp x cp with cp), or the compute copy CastWeights makes under --mixed-precision params
    wrapped = mesh.get("dp", 1) * mesh.get("cp", 1) > 1 or any(stage.get("unsharded_bytes") for stage in stages)
    seen, left = set(), {}
    for label, _peak, delta, *made in measured.get("actions") or []:
        action = Action.parse(label) if " " not in label else None
        if action is None or action.kind != "F":
            continue
        first = action.stage not in seen
        seen.add(action.stage)
        if not (wrapped and first):  # what the forward made and left alive, where the meter says
            left.setdefault(action.stage, []).append(made[0] if made else delta)
    return [(stage, min(deltas), stages[stage]["kept"]) for stage, deltas in sorted(left.items())]


def check_case(name: str, case: tuple, folder: str, launch) -> dict:
    """Split, run 2 steps with ``--measure-memory`` through ``launch(out, world, args, env) -> (returncode, output)``,
    and compare. The record says ``ok`` when every rank's peak and every stage's kept bytes are within 10%."""
    from tracepp.driver import split_model

    family, world, options, layout, run = case[:5]
    out = os.path.join(folder, name)
    env = set_case_env(case)  # the model file reads them; the split cache keys on the environment
    manifest = split_model(MODEL, out, layout=layout, run=run, **options)
    report, saved = os.path.join(folder, f"{name}.memory.json"), os.path.join(folder, f"{name}.pt")
    code, output = launch(out, world, ["--steps", "2", "--quiet", "--measure-memory", report, "--save", saved], env)
    record = {"case": name, "family": family, "world": world, "layout": layout.to_json(), "run": run.to_json(),
              "sizes": {k: v for k, v in env.items() if k != "MEMORY_FAMILY"},
              "schedule": options["schedule"], "notes": manifest["memory"]["notes"], "returncode": code,
              "bound": [r for r, entry in enumerate(manifest["memory"]["ranks"]) if entry.get("bound")]}
    if code != 0:
        record.update(ok=False, error=output[-3000:])
        return record
    with open(report) as handle:
        measured = json.load(handle)
    ranks, problems = [], []
    for entry in measured["ranks"]:
        kept = forward_kept(entry["measured"], manifest)
        ranks.append({"rank": entry["rank"], "predicted": entry["predicted"]["peak_bytes"],
                      "measured": entry["measured"]["peak_bytes"], "ratio": round(entry["ratio"], 4),
                      "predicted_at": entry["predicted"]["at"], "measured_at": entry["measured"].get("at"),
                      "kept": [{"stage": s, "measured": round(m), "predicted": p,
                                "ratio": round(m / p, 4) if p else None} for s, m, p in kept]})
        if abs(entry["ratio"] - 1) > TOLERANCE:
            problems.append(f"rank {entry['rank']}: whole peak ratio {entry['ratio']:.3f}")
        problems += [f"rank {entry['rank']} stage {s}: kept ratio {m / p:.3f}" for s, m, p in kept
                     if p and abs(m / p - 1) > TOLERANCE]
    record.update(ok=not problems and measured["differs"] == [], problems=problems, ranks=ranks,
                  differs=measured["differs"], saved=saved)
    return record


def _torchrun(out: str, world: int, args: list, env: dict) -> tuple:
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.join(out, "run.py"), *args]
    base = {k: v for k, v in os.environ.items() if k not in SIZES}
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500,
                            env=dict(base, OMP_NUM_THREADS="1", **env))
    return result.returncode, result.stdout + result.stderr


def _kept_ratios(record: dict) -> list:
    """Measured over counted kept bytes, every stage of every rank of a case's record."""
    return [k["ratio"] for r in record.get("ranks", []) for k in r["kept"] if k["ratio"]]


def table(result: dict) -> str:
    """docs/memory.md's table from a result file: per case and rank, predicted and measured peak and their ratio,
    and the range of kept-bytes ratios over its stages."""
    lines = ["| case | ranks | rank: predicted / measured peak (measured / predicted) | kept per microbatch, measured / counted | "
             "within 10% |", "| --- | --- | --- | --- | --- |"]
    for row in result["cases"]:
        if not row.get("ranks"):
            lines.append(f"| {row['case']} | {row['world']} | failed | - | no |")
            continue
        peaks = "; ".join(f"{r['rank']}: {r['predicted'] / 2**20:.1f} / {r['measured'] / 2**20:.1f} MiB "
                          f"({r['ratio']:.3f})" for r in row["ranks"])
        kept = _kept_ratios(row)
        kept_text = f"{min(kept):.3f} - {max(kept):.3f}" if kept else "-"
        lines.append(f"| {row['case']} | {row['world']} | {peaks} | {kept_text} | {'yes' if row['ok'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases = _cases()
    parser.add_argument("--cases", default=",".join(cases), help="comma-separated case names")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--table", metavar="RESULT", help="print docs/memory.md's table from a result file")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as handle:
            print(table(json.load(handle)))
        return 0
    from benchmarks import write_result

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.cases.split(","):
            record = check_case(name, cases[name], folder, _torchrun)
            record.pop("saved", None)
            rows.append(record)
            ratios = ", ".join(f"{r['ratio']:.3f}" for r in record.get("ranks", []))
            kept = _kept_ratios(record)
            print(f"{name:48s} peak measured/predicted {ratios}; kept {min(kept, default=0):.3f}-"
                  f"{max(kept, default=0):.3f} {'ok' if record['ok'] else 'OFF: ' + '; '.join(record.get('problems') or [record.get('error', '')])}",
                  flush=True)
    import torch

    write_result(args.out, "memory_check", {"torch": torch.__version__, "tolerance": TOLERANCE,
                                            "method": __doc__.split("\n\n")[2], "cases": rows})
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
