"""Context parallelism (issue 48): the exactness matrix, and what it saves per rank.

    python -m benchmarks.context_parallel exact  [--out benchmarks/results] [--only NAME,...]
    python -m benchmarks.context_parallel memory [--out benchmarks/results]

``exact`` runs the matrix the test suite cannot afford on 2 cores: for every case a split, a torchrun on gloo
(``--save`` the trained state) and eager training of the unsplit model on the same batches (the model file's
optimizer, the same clipping), and records the largest difference over every parameter (fp32; the bar is 2e-5):
the hand-written Llama (``tests/models/tp_llama.py``: GQA, rotary from ``arange``, tied head, AdamW) under 1F1B,
interleaved 1F1B and interleaved zero-bubble (the untied Hugging Face Llama under ZBV and DualPipeV), with full
activation checkpointing, at cp 2 and 4, with dp 2 (FSDP, DDP, HSDP over
dp x cp), with tp 2 and sequence parallelism, with a dynamic sequence, with ``--compile``; the Hugging Face
families of ``tests/zoo/cp_hf.py`` (Llama, Qwen3, Gemma3 with a 5-token sliding window, GPT-2, Mixtral,
DeepSeek-V3 MLA) with targets padded by ignore_index unevenly over the cp ranks, in sdpa and eager attention,
with ``--ep 2`` taken from the cp ranks, with tp 2 and sequence parallelism, at cp 4, with a ``[batch, seq]``
padding mask passed as an input.

``memory`` measures what cp saves on the benchmark-size Llama (``TP_LLAMA_SIZE=bench``: hidden 512, 8 heads, 4
key/value heads, SwiGLU 1536, vocabulary 8192, 4 layers) at pp 2, 1F1B, 2 microbatches of 4 samples x 64
tokens, at cp 1, 2 and 4 (2, 4 and 8 processes), the way ``benchmarks.tensor_parallel sequence`` measures
sequence parallelism: (a) every rank's bytes of activations kept for backward over one training step
(``benchmarks/cp_memory_worker.py``: ``saved_tensors_hooks``, each storage once, parameters left out), classed by
the last dim (hidden width or 1: between attention and MLP; vocabulary: the logits and the loss; other floating:
inside attention and the MLP; integer); (b) the pipeline boundary bytes per rank per microbatch from each
manifest's ``values``; (c) the key/value bytes the all-gathers move: predicted from the manifest
(``cp.stages[k].kv_received_bytes_per_rank``, per microbatch) and counted by the runtime on every rank over the
step (``context_parallel.count_exchange``: bytes received by the all-gathers, sent by the dK/dV reduce-scatters).
Byte counts are deterministic: one run, no times (8 processes on 2 cores measure contention, not speed).
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
TESTS = os.path.join(REPO, "tests")
LLAMA = os.path.join(TESTS, "models", "tp_llama.py")
HF = os.path.join(TESTS, "zoo", "cp_hf.py")
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS, os.path.join(TESTS, "zoo")]),
                OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", **extra)


def _run(command: list, env: dict, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def _torchrun(nproc: int, *args: str, env: dict) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                 *args], env)


# ---- exact

def _case(name, model, layout, schedule="1f1b", microbatches=2, steps=2, env=None, args=(), clip=None, stages=None):
    return {"name": name, "model": model, "layout": layout, "schedule": schedule, "microbatches": microbatches,
            "steps": steps, "env": dict(env or {}), "args": list(args), "clip": clip, "stages": stages}


def cases() -> list:
    llama = "tests/models/tp_llama.py"
    out = [
        _case("llama pp2 cp2 1f1b adamw clip", llama, dict(pp=2, cp=2), clip=1.0),
        _case("llama pp2 cp2 interleaved-1f1b", llama, dict(pp=2, cp=2), "interleaved-1f1b", 4),
        _case("llama pp2 cp2 interleaved-zb", llama, dict(pp=2, cp=2), "interleaved-zb", 4),
        # V schedules put a tied embedding and head on one rank, which FSDP over dp x cp cannot wrap (refused at
        # split, as with --dp): the untied Hugging Face Llama runs them
        _case("hf llama pp2 cp2 zbv padded", "tests/zoo/cp_hf.py", dict(pp=2, cp=2), "zbv", 4,
              env={"CP_HF_FAMILY": "llama"}, stages=4),
        _case("hf llama pp2 cp2 dualpipev padded", "tests/zoo/cp_hf.py", dict(pp=2, cp=2), "dualpipev", 4,
              env={"CP_HF_FAMILY": "llama"}, stages=4),
        _case("llama pp2 cp4", llama, dict(pp=2, cp=4)),
        _case("llama pp1 dp2 cp2 fsdp", llama, dict(pp=1, dp=2, cp=2)),
        _case("llama pp1 dp2 cp2 ddp", llama, dict(pp=1, dp=2, cp=2, dp_mode="ddp")),
        _case("llama pp1 dp2 cp2 hsdp", llama, dict(pp=1, dp=2, cp=2, dp_mode="hsdp", dp_shard=1)),
        _case("llama pp2 dp2 cp2 fsdp", llama, dict(pp=2, dp=2, cp=2)),
        _case("llama pp1 cp2 tp2 sp", llama, dict(pp=1, cp=2, tp=2, sequence_parallel=True)),
        _case("llama pp2 cp2 tp2 sp", llama, dict(pp=2, cp=2, tp=2, sequence_parallel=True)),
        _case("llama pp2 cp2 dynamic sequence (16, 8, 12)", llama, dict(pp=2, cp=2), steps=3,
              env={"TP_LLAMA_SEQ": "dynamic"}),
        _case("llama pp1 cp2 --compile", llama, dict(pp=1, cp=2), args=["--compile", "--timeout", "600"]),
        _case("llama pp2 cp2 full activation checkpointing", llama, dict(pp=2, cp=2),
              args=["--activation-checkpointing", "full"]),
    ]
    for family in ("llama", "qwen3", "gemma3", "gpt2", "mixtral", "deepseek_v3"):
        out.append(_case(f"hf {family} pp2 cp2 padded", "tests/zoo/cp_hf.py", dict(pp=2, cp=2),
                         env={"CP_HF_FAMILY": family}))
    for family in ("llama", "gemma3"):
        out.append(_case(f"hf {family} pp2 cp2 padded, eager attention", "tests/zoo/cp_hf.py", dict(pp=2, cp=2),
                         env={"CP_HF_FAMILY": family, "CP_HF_ATTENTION": "eager"}))
    out += [
        _case("hf mixtral pp2 cp2 ep2 padded", "tests/zoo/cp_hf.py", dict(pp=2, cp=2, ep=2),
              env={"CP_HF_FAMILY": "mixtral"}),
        _case("hf deepseek_v3 pp2 cp2 ep2 padded", "tests/zoo/cp_hf.py", dict(pp=2, cp=2, ep=2),
              env={"CP_HF_FAMILY": "deepseek_v3"}),
        _case("hf qwen3 pp1 cp2 tp2 sp padded", "tests/zoo/cp_hf.py", dict(pp=1, cp=2, tp=2,
                                                                           sequence_parallel=True),
              env={"CP_HF_FAMILY": "qwen3"}, stages=1),
        _case("hf gemma3 pp1 cp4 padded (window 5 over chunks of 2)", "tests/zoo/cp_hf.py", dict(pp=1, cp=4),
              env={"CP_HF_FAMILY": "gemma3"}, stages=1),
        _case("hf gpt2 pp2 cp4 padded", "tests/zoo/cp_hf.py", dict(pp=2, cp=4), env={"CP_HF_FAMILY": "gpt2"}),
        _case("hf llama pp2 cp2 [batch, seq] attention_mask input", "tests/zoo/cp_hf.py", dict(pp=2, cp=2),
              env={"CP_HF_FAMILY": "llama", "CP_HF_PAD": "0", "CP_HF_MASK": "1"}),
    ]
    return out


_EAGER = r'''
import json, sys, torch
sys.path[:0] = [{tests!r}]
from util import eager_train
from test_e2e_dp import _eager_adamw
path, steps, clip, saved, out = {path!r}, {steps}, {clip!r}, {saved!r}, {out!r}
expected = _eager_adamw(path, steps, clip)[0] if clip else eager_train(path, steps)
actual = torch.load(saved)
worst = {{k: float((actual[k].float() - expected[k].float()).abs().max()) for k in expected}}
initial = {{k: v for k, v in __import__("tracepp.modelfile", fromlist=["x"]).load_model_file(path).model().state_dict().items()}}
moved = max(float((actual[k].float() - initial[k].float()).abs().max()) for k in initial)
json.dump({{"max_abs_diff": max(worst.values()), "worst_parameter": max(worst, key=worst.get), "moved": moved,
           "keys_equal": sorted(actual) == sorted(expected)}}, open(out, "w"))
'''


def _exact_case(case: dict, root: str) -> dict:
    from tracepp.runtime.mesh import Layout

    layout = Layout(**case["layout"])
    folder = os.path.join(root, case["name"].replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""))
    env = _env(**case["env"])
    path = os.path.join(REPO, case["model"])
    started = time.time()
    split = [sys.executable, "-c",
             "import sys; from tracepp.driver import split_model; from tracepp.runtime.mesh import Layout; "
             f"split_model({path!r}, {folder!r}, schedule={case['schedule']!r}, "
             f"num_microbatches={case['microbatches']}, layout=Layout(**{case['layout']!r})"
             + (f", num_stages={case['stages']}, split_points='auto')" if case["stages"] else ")")]
    result = _run(split, env)
    record = dict(case, processes=layout.world_size)
    if result.returncode:
        return dict(record, error=f"split: {result.stderr[-1500:]}")
    record["split_s"] = round(time.time() - started, 1)
    saved = os.path.join(folder, "final.pt")
    run = [os.path.join(folder, "run.py"), "--quiet", "--steps", str(case["steps"]), "--save", saved,
           *(["--clip-grad-norm", str(case["clip"])] if case["clip"] else []), *case["args"]]
    started = time.time()
    result = _torchrun(layout.world_size, *run, env=env)
    record["run_s"] = round(time.time() - started, 1)
    if result.returncode:
        return dict(record, error=f"run: {result.stderr[-2000:]}")
    compared = os.path.join(folder, "compared.json")
    result = _run([sys.executable, "-c", _EAGER.format(tests=TESTS, path=path, steps=case["steps"],
                                                      clip=case["clip"], saved=saved, out=compared)], env)
    if result.returncode:
        return dict(record, error=f"eager: {result.stderr[-1500:]}")
    with open(compared) as handle:
        record.update(json.load(handle))
    record["within_2e-5"] = record["max_abs_diff"] <= 2e-5 and record["moved"] > 1e-4 and record["keys_equal"]
    return record


def exact(root: str, only=None) -> dict:
    results = []
    for case in cases():
        if only and not any(word in case["name"] for word in only):
            continue
        record = _exact_case(case, root)
        print(f"{case['name']}: {record.get('max_abs_diff', record.get('error', '')[:300])}", flush=True)
        results.append(record)
    return {"cases": results, "all_within_2e-5": all(r.get("within_2e-5") for r in results),
            "largest_difference": max((r.get("max_abs_diff", float("inf")) for r in results), default=None)}


# ---- memory

def _boundary(manifest: dict) -> dict:
    forward = backward = 0
    values = {}
    for name, value in manifest["values"].items():
        count = 1
        for dim in value["shape"]:
            count *= int(dim)
        size = count * DTYPE_BYTES[value["dtype"]] * len(value["consumers"])
        forward += size
        backward += size if value.get("requires_grad") else 0
        values[name] = {"shape": value["shape"], "dtype": value["dtype"], "bytes": size}
    return {"forward_bytes": forward, "backward_bytes": backward, "values": values}


def memory(root: str) -> dict:
    import importlib.util

    previous = os.environ.get("TP_LLAMA_SIZE")
    os.environ["TP_LLAMA_SIZE"] = "bench"
    try:
        spec = importlib.util.spec_from_file_location("tp_llama_bench", LLAMA)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            os.environ.pop("TP_LLAMA_SIZE")
        else:
            os.environ["TP_LLAMA_SIZE"] = previous
    env = _env(TP_LLAMA_SIZE="bench")
    runs, boundaries, predicted = {}, {}, {}
    for cp in (1, 2, 4):
        key = f"cp{cp}"
        out = os.path.join(root, key)
        options = ["--cp", str(cp)] if cp > 1 else []
        result = _run([sys.executable, "-m", "tracepp", "split", LLAMA, "-o", out, "--ranks", "2", "--schedule",
                       "1f1b", "--microbatches", "2", *options], env)
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        saved = os.path.join(root, f"saved_{key}.json")
        result = _torchrun(2 * cp, "-m", "benchmarks.cp_memory_worker", out, "--hidden", str(module.D), "--vocab",
                           str(module.VOCAB), "--json", saved, env=env)
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        with open(saved) as handle:
            runs[key] = json.load(handle)
        with open(os.path.join(out, "manifest.json")) as handle:
            manifest = json.load(handle)
        boundaries[key] = _boundary(manifest)
        stages = (manifest.get("cp") or {}).get("stages", [])
        microbatches = manifest["plan"]["num_microbatches"]
        predicted[key] = {str(s): {"kv_whole_bytes_per_microbatch": stage["kv_bytes"],
                                   "kv_received_bytes_per_rank_per_step": stage["kv_received_bytes_per_rank"]
                                   * microbatches,
                                   "gathers_per_microbatch": len(stage["gathered"])}
                          for s, stage in enumerate(stages)}
    summary = {}
    for key, ranks in runs.items():
        per_pp = {}
        for rank in ranks:
            per_pp.setdefault(str(rank["pp_rank"]), []).append(rank)
        summary[key] = {}
        for pp, members in sorted(per_pp.items()):
            entry = {"saved_bytes": max(r["saved_bytes"] for r in members),
                     "saved_bytes_min_over_cp": min(r["saved_bytes"] for r in members),
                     "by_class": {kind: max(r["by_class"].get(kind, 0) for r in members)
                                  for kind in ("between", "inside", "vocabulary", "integer")},
                     "kv_received_by_all_gathers": max(r["exchanged"].get("all_gather", 0) for r in members),
                     "dkv_sent_by_reduce_scatters": max(r["exchanged"].get("reduce_scatter", 0) for r in members),
                     "all_gather_calls": max(r["exchanged"].get("all_gather_calls", 0) for r in members)}
            summary[key][pp] = entry
    for key in summary:
        for pp, entry in summary[key].items():
            one = summary["cp1"][pp]
            entry["ratio_to_cp1"] = round(entry["saved_bytes"] / one["saved_bytes"], 4)
            entry["class_ratio_to_cp1"] = {kind: round(v / one["by_class"][kind], 4) if one["by_class"][kind] else None
                                           for kind, v in entry["by_class"].items()}
            want = predicted[key].get(pp, {}).get("kv_received_bytes_per_rank_per_step", 0)
            entry["kv_predicted_per_step"] = want
            entry["kv_measured_over_predicted"] = (round(entry["kv_received_by_all_gathers"] / want, 4)
                                                   if want else None)
        boundaries[key]["ratio_to_cp1"] = round(boundaries[key]["forward_bytes"] / boundaries["cp1"]["forward_bytes"],
                                                4)
    losses = {key: next(r["loss"] for r in ranks if r["loss"] is not None) for key, ranks in runs.items()}
    return {"model": "tests/models/tp_llama.py with TP_LLAMA_SIZE=bench", "pp": 2, "schedule": "1f1b",
            "num_microbatches": 2, "microbatch": [module.BATCH // 2, module.SEQ], "hidden": module.D,
            "vocab": module.VOCAB, "layers": module.LAYERS, "loss_of_the_step": losses,
            "classification": "by the last dim of the first saved tensor on each storage: hidden width or 1 = "
                              "between attention and MLP; vocabulary = logits and loss; other floating = inside "
                              "attention and MLP; integer = ids, targets, positions",
            "saved_per_pp_rank_max_over_cp": summary, "boundary_per_rank_per_microbatch": boundaries,
            "kv_predicted_per_stage": predicted, "per_rank": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["exact", "memory"])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--only", default=None, help="exact: only the cases whose name contains one of these")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        record = {"what": args.what, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "machine": f"{os.cpu_count()} cores, gloo on CPU",
                  **(exact(root, args.only.split(",") if args.only else None) if args.what == "exact"
                     else memory(root))}
    print(json.dumps({k: v for k, v in record.items() if k not in ("per_rank", "cases")}, indent=1))
    write_result(args.out, f"context_parallel_{args.what}", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
