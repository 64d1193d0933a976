"""Tensor parallelism inside stages (issue 33): exactness on the full 3-D mesh, and per-rank memory.

    python -m benchmarks.tensor_parallel exact  [--out benchmarks/results]   # dp=2 x pp=2 x tp=2: 8 processes
    python -m benchmarks.tensor_parallel memory [--out benchmarks/results]   # tp=1 vs tp=2, pp=2, per rank
    python -m benchmarks.tensor_parallel collectives [--out ...]            # the tuner's collective price vs gloo
    python -m benchmarks.tensor_parallel sequence [--out ...]               # activations and boundaries: tp1, tp2, tp2+SP
    python -m benchmarks.tensor_parallel step [--cases tp2,tp2_sp,pp2_tp2,pp2_tp2_sp] [--rounds 3]
                                                                          # step time against parallelize_module

``exact`` splits ``tests/models/tp_llama.py`` (grouped-query attention, tied embedding and head) with
``--ranks 2 --dp 2 --tp 2`` (FSDP2 over dp, DTensor shards over tp), trains 3 steps with the model file's AdamW
and ``--clip-grad-norm 1``, and compares every parameter with eager training of the unsplit model on the
global batch (the test suite runs pp=2 x tp=2; 8 processes are too many for it on 2 cores).

``memory`` splits the same model at benchmark size (``TP_LLAMA_SIZE=bench``: hidden 512, 8 heads, 4 kv heads,
SwiGLU 1536, vocabulary 8192, 4 layers; 16.8M parameters) at pp=2 with tp=1 and tp=2, runs one AdamW step of
each through ``benchmarks/tp_memory_worker.py`` and records every rank's bytes of parameters, gradients and
optimizer state as they sit in memory (a DTensor's local shard), for the parameters the tp=2 plan shards and
for the rest. The ratio tp2/tp1 of the sharded layers is the issue's "about half".

``collectives`` checks the price ``plan --tune --tp-sizes`` puts on the collectives tensor parallelism adds
(``tracepp.costs.search.collective_s``: ring steps priced from the 2-rank all-reduce and all-gather that
``tracepp calibrate`` fits) against gloo's own all-reduce and all-gather of the same sizes on 2 and 4 ranks
(``benchmarks/tp_collectives_worker.py``; 4 ranks share this machine's cores when it has fewer).

``sequence`` measures sequence parallelism on the ``memory`` model (``TP_LLAMA_SIZE=bench``, pp=2, 1F1B, 2
microbatches of 4 samples x 64 tokens) at tp=1, tp=2 and tp=2 with ``--sequence-parallel``: (a) every rank's
bytes of activations kept for backward over one training step (``benchmarks/tp_activation_worker.py``:
``saved_tensors_hooks`` around ``Pipeline.step``, the storage behind each saved tensor counted once, parameters
left out), split by the last dim of the saved tensor into values between the tensor-parallel regions (hidden
width or 1), inside them, the vocabulary-wide ones and integers; (b) the pipeline boundary bytes per rank per
microbatch, from each manifest's ``values`` (shapes, dtypes; forward, and backward for values that carry a
gradient), with the collectives per stage from ``manifest["tp"]["stages"]``; (c) the tuner's activation figure
for the same three layouts (``manifest["segments"][k]["tp"]``, per stage) beside the measurement. Byte counts
are deterministic: one run, no medians, no times (4 processes on 2 cores).

``step`` times tracepp's tensor parallelism against torch's own (``parallelize_module`` on DTensors with the plan
a torchtitan user writes for Llama: ``benchmarks/tp_torch_worker.py``) on the same Hugging Face Llama
(``benchmarks/hf_llama_model.py``: hidden 256, 8 heads / 4 kv heads, SwiGLU 768, 4 layers, vocabulary 4096, a
batch of 4 x 128 tokens, SGD), in paired rounds (``benchmarks/paired.py``: the systems alternate, each run a
fresh torchrun of warm-up + measured steps; the ratio is the median over rounds of the rounds' median step times).
Cases: ``tp2`` and ``tp2_sp`` (``--sequence-parallel``) on 2 processes, one pipeline rank holding the whole model
(tracepp ``--ranks 1 --tp 2 --microbatches 1``: one forward and backward of the full batch, as the peer); and
``pp2_tp2``, ``pp2_tp2_sp`` on 4 processes, 1F1B over 4 microbatches, split at ``model.layers.2`` (the peer:
hand-built stages, ``PipelineStage`` and ``Schedule1F1B`` around the same tp plan, torchtitan's recipe): on a
2-core machine these measure contention. Both systems save their parameters after the last step; each is held
against the other and against eager training of the unsplit model on the same batches (asserted within
``--tolerance``, the max differences recorded). tracepp runs with ``--on-nonfinite continue`` (no gradient-norm
check; the peer checks nothing) and its defaults otherwise. Every run ends with two untimed steps, the memory
window of ``benchmarks/memory.py`` (tracepp through ``benchmarks/tracepp_worker.py``): the peak of live bytes one
training step adds, per rank, and the ``c10d`` ops it issued.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = os.path.join(REPO, "tests", "models", "tp_llama.py")
CLIP = 1.0
STEPS = 3


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)


def _run(command: list, env: dict) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result.stdout


def _split(out: str, env: dict, *options: str) -> None:
    _run([sys.executable, "-m", "tracepp", "split", MODEL, "-o", out, "--ranks", "2", *options], env)


def _torchrun(nproc: int, *args: str, env: dict) -> str:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args],
                env)


def exact(root: str) -> dict:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_e2e_dp import _eager_adamw

    out, ckpt = os.path.join(root, "dp2pp2tp2"), os.path.join(root, "final.pt")
    env = _env()
    _split(out, env, "--dp", "2", "--tp", "2", "--microbatches", "2")
    start = time.perf_counter()
    _torchrun(8, os.path.join(out, "run.py"), "--steps", str(STEPS), "--clip-grad-norm", str(CLIP), "--save", ckpt,
              "--quiet", env=env)
    wall = time.perf_counter() - start
    expected, norms, losses = _eager_adamw(MODEL, STEPS, CLIP)
    saved = torch.load(ckpt)
    diffs = {fqn: float((saved[fqn] - expected[fqn]).abs().max()) for fqn in expected}
    worst = max(diffs, key=diffs.get)
    return {"mesh": {"dp": 2, "pp": 2, "tp": 2, "processes": 8, "dp_mode": "fsdp"}, "steps": STEPS, "clip": CLIP,
            "optimizer": "AdamW (model file)", "eager_losses": losses, "eager_grad_norms": norms,
            "max_abs_diff": diffs[worst], "worst_parameter": worst, "tolerance": 2e-5,
            "equal_within_tolerance": diffs[worst] <= 2e-5, "tied_copies_identical":
                bool(torch.equal(saved["embed.weight"], saved["head.weight"])), "torchrun_wall_s": round(wall, 1)}


def memory(root: str) -> dict:
    env = _env(TP_LLAMA_SIZE="bench")
    runs = {}
    tp2 = os.path.join(root, "tp2")
    _split(tp2, env, "--tp", "2", "--microbatches", "2")
    for tp in (1, 2):
        out = tp2 if tp == 2 else os.path.join(root, "tp1")
        if tp == 1:
            _split(out, env, "--microbatches", "2")
        result = os.path.join(root, f"memory_tp{tp}.json")
        _torchrun(2 * tp, "-m", "benchmarks.tp_memory_worker", out, "--plan-from", tp2, "--json", result, env=env)
        with open(result) as handle:
            runs[f"tp{tp}"] = json.load(handle)
    summary = {}
    for kind in ("sharded", "other"):
        for what in ("param", "grad", "optimizer"):
            key = f"{kind}_{what}_bytes"
            one = max(rank[key] for rank in runs["tp1"])
            two = max(rank[key] for rank in runs["tp2"])
            summary[key] = {"tp1_max_rank": one, "tp2_max_rank": two, "ratio": round(two / one, 4) if one else None}
    total = {tp: max(sum(v for k, v in rank.items() if k.endswith("_bytes")) for rank in runs[tp])
             for tp in runs}
    summary["all_bytes"] = {"tp1_max_rank": total["tp1"], "tp2_max_rank": total["tp2"],
                            "ratio": round(total["tp2"] / total["tp1"], 4)}
    with open(os.path.join(tp2, "manifest.json")) as handle:
        params = json.load(handle)["tp"]["params"]
    return {"model": "tests/models/tp_llama.py with TP_LLAMA_SIZE=bench", "pp": 2,
            "sharded_parameters": sum(1 for e in params.values() if e["dim"] is not None),
            "parameters": len(params), "per_rank": runs, "summary": summary}


def collectives(root: str) -> dict:
    out = {}
    for world in (2, 4):
        result = os.path.join(root, f"collectives_{world}.json")
        _torchrun(world, "-m", "benchmarks.tp_collectives_worker", "--json", result, env=_env())
        with open(result) as handle:
            out[f"tp{world}"] = json.load(handle)
    return out


DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}
LAYOUTS = (("tp1", []), ("tp2", ["--tp", "2"]), ("tp2_sp", ["--tp", "2", "--sequence-parallel"]))


def _boundary(manifest: dict) -> dict:
    """Per rank per microbatch: the bytes each pipeline rank sends its counterpart (forward values and, for those
    that carry one, their gradients back), each value's local shape, and the collectives each stage adds."""
    values = {}
    forward = backward = 0
    for name, value in manifest["values"].items():
        count = 1
        for dim in value["shape"]:
            count *= int(dim)
        size = count * DTYPE_BYTES[value["dtype"]] * len(value["consumers"])
        forward += size
        backward += size if value.get("requires_grad") else 0
        values[name] = {"shape": value["shape"], "dtype": value["dtype"], "bytes": size,
                        "requires_grad": bool(value.get("requires_grad"))}
    collectives = []
    for stage in (manifest.get("tp") or {}).get("stages", []):
        ops: dict = {}
        for entry in stage["collectives"]:
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            n, total = ops.get(entry["op"], (0, 0))
            ops[entry["op"]] = (n + 1, total + count * DTYPE_BYTES[entry["dtype"]])
        collectives.append({op: {"count": n, "whole_bytes": b} for op, (n, b) in sorted(ops.items())})
    sp = (manifest.get("tp") or {}).get("sequence_parallel")
    return {"forward_bytes": forward, "backward_bytes": backward, "values": values,
            "sent_as_sequence_shards": sp["sent"] if sp else {}, "collectives_per_stage_whole_bytes": collectives}


def _predicted(manifest: dict) -> dict:
    """The tuner's activation figure per stage of the tp=1 folder's split, per microbatch, at tp 1, 2 and 2 with
    sequence parallelism (``manifest["segments"][k]["tp"]``), where the split recorded it."""
    out = {}
    for key, tp, sp in (("tp1", 1, False), ("tp2", 2, False), ("tp2_sp", 2, True)):
        per_stage: dict = {}
        for seg in manifest["segments"]:
            fig = (seg.get("tp") or {}).get(str(tp), {}) if tp > 1 else {}
            if sp:
                fig = fig.get("sequence_parallel") or {}
            kept = seg["activation_bytes"] - (fig.get("sharded_activation_bytes", 0)
                                              + fig.get("sequence_activation_bytes", 0)) * (1 - 1 / tp)
            per_stage[seg["stage"]] = per_stage.get(seg["stage"], 0) + kept
        out[key] = {str(stage): int(v) for stage, v in sorted(per_stage.items())}
    return out


def sequence(root: str) -> dict:
    sys.path.insert(0, os.path.join(REPO, "tests", "models"))
    env = _env(TP_LLAMA_SIZE="bench")
    import importlib.util

    spec = importlib.util.spec_from_file_location("tp_llama_bench", MODEL)
    previous = os.environ.get("TP_LLAMA_SIZE")
    os.environ["TP_LLAMA_SIZE"] = "bench"
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            os.environ.pop("TP_LLAMA_SIZE")
        else:
            os.environ["TP_LLAMA_SIZE"] = previous
    runs, boundaries = {}, {}
    for key, options in LAYOUTS:
        out = os.path.join(root, key)
        _split(out, env, "--schedule", "1f1b", "--microbatches", "2", *options)
        tp = 2 if options else 1
        result = os.path.join(root, f"saved_{key}.json")
        _torchrun(2 * tp, "-m", "benchmarks.tp_activation_worker", out, "--hidden", str(module.D), "--vocab",
                  str(module.VOCAB), "--json", result, env=env)
        with open(result) as handle:
            runs[key] = json.load(handle)
        with open(os.path.join(out, "manifest.json")) as handle:
            manifest = json.load(handle)
        boundaries[key] = _boundary(manifest)
        if key == "tp1":  # the tuner's figures: computed as `plan --tune --tp-sizes 1,2` would
            from tracepp.codegen.manifest import load_manifest
            from tracepp.tuner_figures import ensure

            predicted = _predicted(ensure(load_manifest(out), out, tp_sizes=[2], say=lambda text: None))
    summary = {}
    for key in runs:
        per_pp = {}
        for rank in runs[key]:
            per_pp.setdefault(str(rank["pp_rank"]), []).append(rank)
        summary[key] = {pp: {"saved_bytes": max(r["saved_bytes"] for r in ranks),
                             "by_class": {kind: max(r["by_class"].get(kind, 0) for r in ranks)
                                          for kind in ("between", "inside", "vocabulary", "integer")}}
                        for pp, ranks in sorted(per_pp.items())}
    # the column-parallel linears' inputs (saved as [tokens, hidden] for their matmul): with --sequence-parallel
    # the all-gathered input, kept whole; Megatron-Core keeps the shard and gathers it again in backward
    region_inputs = f"between [{module.BATCH // 2 * module.SEQ}, {module.D}] float32"
    for key in runs:
        tp = 2 if key != "tp1" else 1
        for pp, entry in summary[key].items():
            ranks = [r for r in runs[key] if str(r["pp_rank"]) == pp]
            entry["region_input_bytes"] = max(r["by_shape"].get(region_inputs, {}).get("bytes", 0) for r in ranks)
            if key == "tp2_sp":
                entry["computed_if_region_inputs_kept_as_shards"] = int(
                    entry["saved_bytes"] - entry["region_input_bytes"] * (1 - 1 / tp))
    for key in runs:
        for pp, entry in summary[key].items():
            one = summary["tp1"][pp]
            entry["ratio_to_tp1"] = round(entry["saved_bytes"] / one["saved_bytes"], 4)
            if "computed_if_region_inputs_kept_as_shards" in entry:
                entry["computed_ratio_if_region_inputs_kept_as_shards"] = round(
                    entry["computed_if_region_inputs_kept_as_shards"] / one["saved_bytes"], 4)
            entry["class_ratio_to_tp1"] = {kind: round(v / one["by_class"][kind], 4) if one["by_class"][kind] else None
                                           for kind, v in entry["by_class"].items()}
        boundaries[key]["ratio_to_tp1"] = round(boundaries[key]["forward_bytes"] / boundaries["tp1"]["forward_bytes"], 4)
    return {"model": "tests/models/tp_llama.py with TP_LLAMA_SIZE=bench", "pp": 2, "schedule": "1f1b",
            "num_microbatches": 2, "microbatch": [module.BATCH // 2, module.SEQ], "hidden": module.D,
            "vocab": module.VOCAB, "layers": module.LAYERS,
            "classification": "by the last dim of the first saved tensor on each storage: hidden width or 1 = "
                              "between the tensor-parallel regions; vocabulary or vocabulary/tp = vocabulary; "
                              "other floating = inside the regions; integer = ids and targets",
            "saved_per_pp_rank_max_over_tp": summary, "boundary_per_rank_per_microbatch": boundaries,
            "tuner_activation_figure_per_stage": predicted, "per_rank": runs}


STEP_MODEL = os.path.join(HERE, "hf_llama_model.py")
STEP_CASES = {"tp2": (1, False), "tp2_sp": (1, True), "pp2_tp2": (2, False), "pp2_tp2_sp": (2, True)}
PP_MICROBATCHES = 4


def step(root: str, cases: list, rounds: int, warmup: int, steps: int, tolerance: float, tiny: bool,
         extra_args: tuple = ()) -> dict:
    from benchmarks import paired

    extra = {"HF_LLAMA_BENCH_SIZE": "tiny"} if tiny else {}
    environment = paired.env(**extra)
    from benchmarks.memory import MEMORY_STEPS, read_memory

    total = warmup + steps + MEMORY_STEPS  # the last two: the memory window, untimed
    eager = paired.eager_train(STEP_MODEL, total, extra)
    out = {"model": "benchmarks/hf_llama_model.py" + (" (tiny)" if tiny else ""), "rounds": rounds,
           "warmup_steps": warmup, "measured_steps": steps, "tolerance": tolerance, "cases": {}}
    for case in cases:
        pp, sp = STEP_CASES[case]
        nproc = 2 * pp
        folder = os.path.join(root, case)
        options = ["--ranks", str(pp), "--tp", "2"] + (["--sequence-parallel"] if sp else [])
        options += (["--microbatches", "1"] if pp == 1 else
                    ["--schedule", "1f1b", "--microbatches", str(PP_MICROBATCHES), "--split-points", "model.layers.2"])
        _run([sys.executable, "-m", "tracepp", "split", STEP_MODEL, "-o", folder, *options], environment)
        print(f"{case}: {nproc} processes", flush=True)

        def tracepp_run(round_index, folder=folder, nproc=nproc, case=case):
            metrics, save, memory = (os.path.join(root, f"{case}_tracepp_{round_index}{x}")
                                     for x in (".jsonl", ".pt", "_mem"))
            result = paired.run_logged(paired.torchrun(nproc, "-m", "benchmarks.tracepp_worker", folder, "--memory-dir",
                                                       memory, "--", "--steps", str(total), "--metrics", metrics,
                                                       "--quiet", "--on-nonfinite", "continue", "--save", save, *extra_args),
                                       metrics + ".log", environment, 900)
            result["measured"] = paired.measured(paired.read_metrics(metrics), warmup, steps)
            result.update(save=save, memory=read_memory(memory))
            return result

        def torch_run(round_index, nproc=nproc, case=case, pp=pp, sp=sp):
            metrics, save, memory = (os.path.join(root, f"{case}_torch_{round_index}{x}")
                                     for x in (".jsonl", ".pt", "_mem"))
            command = paired.torchrun(nproc, "-m", "benchmarks.tp_torch_worker", "--model-file", STEP_MODEL, "--tp", "2",
                                      "--pp", str(pp), "--steps", str(total), "--metrics", metrics, "--save", save,
                                      "--memory-dir", memory)
            if pp > 1:
                command += ["--microbatches", str(PP_MICROBATCHES)]
            if sp:
                command += ["--sequence-parallel"]
            result = paired.run_logged(command, metrics + ".log", environment, 900)
            result["measured"] = paired.measured(paired.read_metrics(metrics), warmup, steps)
            result.update(save=save, memory=read_memory(memory))
            return result

        runs = paired.run_rounds({"tracepp": tracepp_run, "torch": torch_run}, rounds)
        summary = paired.summarize(runs)
        ours, theirs = torch.load(runs["tracepp"][0]["save"]), torch.load(runs["torch"][0]["save"])
        between, where = paired.max_difference(ours, theirs)
        to_eager = {name: paired.max_difference(torch.load(runs[name][0]["save"]), eager) for name in runs}
        entry = {"processes": nproc, "pp": pp, "tp": 2, "sequence_parallel": sp,
                 "tracepp_options": options + ["run.py --on-nonfinite continue", *extra_args],
                 "torch": "parallelize_module (benchmarks/tp_torch_worker.py)"
                          + (", PipelineStage + Schedule1F1B" if pp > 1 else ""),
                 "microbatches": PP_MICROBATCHES if pp > 1 else 1, "systems": summary,
                 **paired.ratios(summary, "tracepp", "torch"),
                 "max_abs_diff_tracepp_torch": between, "worst_parameter": where,
                 "max_abs_diff_to_eager": {name: value[0] for name, value in to_eager.items()},
                 "losses": {name: [line["loss"] for line in runs[name][0]["measured"]] for name in runs},
                 "peak_memory_mb_per_rank": {name: [m.get("peak_mb") for m in runs[name][0]["memory"]] for name in runs},
                 "comm_ops_per_step_rank0": {name: (runs[name][0]["memory"] or [{}])[0].get("comm_ops")
                                             for name in runs},
                 "contention": nproc > (os.cpu_count() or 1)}
        if between > tolerance or any(value[0] > tolerance for value in to_eager.values()):
            raise AssertionError(f"{case}: parameters differ beyond {tolerance}: tracepp vs torch {between:.3g} "
                                 f"({where}); against eager {to_eager}")
        out["cases"][case] = entry
    return out


def _step_table(record: dict) -> str:
    from tabulate import tabulate

    rows = []
    for case, e in record["cases"].items():
        a, b = e["systems"]["tracepp"], e["systems"]["torch"]
        memory = e["peak_memory_mb_per_rank"]
        rows.append([case, e["processes"], f"{a['step_s'] * 1000:.1f}", f"{b['step_s'] * 1000:.1f}",
                     f"{e['ratio_paired']:.3f}", f"{a['cpu_s'] * 1000:.1f}", f"{b['cpu_s'] * 1000:.1f}",
                     f"{e['cpu_ratio_paired']:.3f}", f"{e['max_abs_diff_tracepp_torch']:.2g}",
                     f"{max(memory['tracepp'] or [0]):.1f} / {max(memory['torch'] or [0]):.1f}",
                     "contention" if e["contention"] else ""])
    return tabulate(rows, headers=["case", "procs", "tracepp ms", "torch ms", "tracepp/torch (paired)",
                                   "tracepp cpu ms", "torch cpu ms", "cpu ratio", "max |diff|",
                                   "peak MB tracepp / torch", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["exact", "memory", "collectives", "sequence", "step"])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--cases", default="tp2,tp2_sp,pp2_tp2,pp2_tp2_sp", help="step: which cases (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="step: paired rounds")
    parser.add_argument("--warmup", type=int, default=3, help="step: warm-up steps dropped per run")
    parser.add_argument("--steps", type=int, default=10, help="step: measured steps per run")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="step: largest parameter difference allowed")
    parser.add_argument("--tiny", action="store_true", help="step: the model's tiny size (a check of the harness)")
    parser.add_argument("--tracepp-args", default="", help="step: more flags for tracepp's run.py (e.g. '--cpu-bind none')")
    parser.add_argument("--name", default="", help="a suffix for the result file's name (e.g. _contended)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        if args.what == "step":
            cases = args.cases.split(",")
            unknown = [c for c in cases if c not in STEP_CASES]
            if unknown:
                parser.error(f"unknown case(s) {unknown}; choose from {', '.join(STEP_CASES)}")
            body = step(root, cases, args.rounds, args.warmup, args.steps, args.tolerance, args.tiny,
                        tuple(args.tracepp_args.split()))
        else:
            body = {"exact": exact, "memory": memory, "collectives": collectives, "sequence": sequence}[args.what](root)
        record = {"what": args.what, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "cores": os.cpu_count(), **body}
    if args.what == "step":
        print(_step_table(record))
    else:
        print(json.dumps({k: v for k, v in record.items() if k != "per_rank"}, indent=1))
    write_result(args.out, f"tensor_parallel_{args.what}{args.name}", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
