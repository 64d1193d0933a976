"""One tracepp stage's training step on one GPU at bf16 and at fp8 (torchao's float8, tensorwise and rowwise): step
time, and the fp8 gradients and parameters against the bf16 run's within the tolerance torchao documents.

Run from the repository root on a machine with one GPU of compute capability 8.9 or more, torch >= 2.11 and
(optionally carried) torchao::

    python benchmarks/fp8_step.py [--steps 6] [--layers 4] [--hidden 2048] [--seq 2048] [--compile]

torchao for torch 2.11 is 0.17.0 (its compatibility table: 0.17 is built against torch 2.11; its float8 training is
Python over ``torch._scaled_mm``). Where there is no internet, fetch its wheel here and carry the folder::

    python3 -m pip download torchao==0.17.0 --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .whl

The script installs what it lacks without the network: ``.whl/torchao-*.whl`` (``pip install --no-index
--no-deps --target``) and this repository itself (tracepp, ``pip install --no-index --no-deps
--no-build-isolation --target``), each into a folder under /tmp it then imports from.

What runs: a Llama-shaped ``LlamaForCausalLM`` from transformers (random weights from a seed, nothing downloaded;
``--layers`` decoder layers, hidden ``--hidden``, 16 heads, 8 key/value heads, intermediate 2.75 x hidden,
vocabulary 32000, head untied so it is a linear too), ``--batch`` samples of ``--seq`` tokens a step in 2
microbatches, split by ``tracepp.driver.split_model`` into one stage on one rank (``--precision bf16``, and
``--precision fp8 --fp8-recipe tensorwise|rowwise``, all with ``--mixed-precision params``: fp32 master weights,
the bf16 copy cast once per step; fp8 runs torchao's float8 matmul in every linear whose dims 16 divides), and
trained through the runtime's public step API (``Pipeline(folder, all_stages=True)``, the model file's batches,
SGD at ``--lr`` on the fp32 masters) for ``--steps`` steps from the same initial weights and data.

Reported (JSON to ``$OUT/fp8_step.json``, else ``./fp8_step.json``, and a table on stdout): per precision the
median step time over the steps after the first two, tokens/s, peak ``torch.cuda.max_memory_allocated``, the
losses; for each fp8 recipe against bf16, torchao's numerics criterion (``test/float8/test_numerics_integration.py``:
SQNR, ``20 log10(|ref| / |ref - fp8|)``, above 20 dB for the outputs and every gradient): the SQNR of the first
step's gradients per parameter (the worst one), and of every parameter's movement after the last step (SGD moves
each by lr x its summed gradients, so the same criterion applies), with ``within_torchao_tolerance`` when every
one is above 20 dB. Everything on one GPU takes well under three minutes at the default size.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SQNR_DB = 20.0  # torchao's float8 numerics test: outputs and gradients above 20 dB against bf16

MODEL = '''"""A Llama-shaped causal LM for benchmarks/fp8_step.py (written by it)."""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS, HIDDEN, SEQ, BATCH, VOCAB = {layers}, {hidden}, {seq}, {batch}, 32000


def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN * 11 // 4,
                         num_hidden_layers=LAYERS, num_attention_heads=16, num_key_value_heads=8,
                         max_position_embeddings=SEQ, tie_word_embeddings=False, attention_dropout=0.0,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(config)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (tokens[:, :-1],), {{"use_cache": False}}, tokens[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return {{"use_cache": False}}


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB).float(), target.reshape(-1))
'''


def _install(what: str, source: str, target: str, extra: list) -> None:
    """``pip install --no-index --no-deps --target target source`` (nothing fetched), then import from target."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--target", target, *extra, source]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"could not install {what} from {source}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    sys.path.insert(0, target)


def _ensure_imports() -> dict:
    """tracepp and torchao importable, installed offline where missing; their versions."""
    try:
        import tracepp.runtime.pipeline  # noqa: F401
    except ImportError:
        _install("tracepp", REPO, "/tmp/fp8_step_tracepp", ["--no-build-isolation"])
    try:
        import torchao  # noqa: F401
    except ImportError:
        wheels = sorted(glob.glob(os.path.join(REPO, ".whl", "torchao-*.whl")))
        if not wheels:
            raise SystemExit("torchao is not installed and there is no .whl/torchao-*.whl to install it from: see "
                             "this script's docstring for the pip download command")
        _install("torchao", wheels[-1], "/tmp/fp8_step_torchao", [])
    import torchao
    import tracepp

    return {"tracepp": tracepp.__version__, "torchao": torchao.__version__}


def sqnr(reference, found) -> float:
    """torchao's ``compute_error``: 20 log10(|reference| / |reference - found|), in dB (inf where equal)."""
    import torch

    reference, found = reference.float(), found.float()
    noise = torch.linalg.vector_norm(reference - found)
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(reference) / noise))


def run(model_path: str, work: str, precision: str, recipe: str, args, device_name: str = "cuda") -> dict:
    """Split for ``precision`` and train ``args.steps`` steps through the Pipeline API on the GPU."""
    import torch

    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.pipeline import Pipeline
    from tracepp.runtime.run_options import RunOptions

    sys.path.insert(0, os.path.dirname(model_path))
    import fp8_step_model as user

    out = os.path.join(work, f"{precision}_{recipe}")
    started = time.perf_counter()
    split_model(model_path, out, num_stages=1, schedule="1f1b", num_microbatches=2, layout=Layout(pp=1),
                run=RunOptions(precision=precision, fp8_recipe=recipe, device="cuda"))
    split_s = time.perf_counter() - started
    device = torch.device(device_name)
    pipe = Pipeline(out, all_stages=True, device=device, compile=args.compile)
    initial = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    torch.cuda.reset_peak_memory_stats(device)
    times, losses, first_grads = [], [], None
    for step in range(args.steps):
        inputs, kwargs, target = user.batch(step)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = pipe.step(inputs, kwargs, target)
        if step == 0:  # the gradients of the same weights and data: torchao's criterion
            first_grads = {name: p.grad.detach().clone() for name, p in pipe.named_parameters() if p.grad is not None}
        optimizer.step()
        pipe.zero_grad()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    moved = {name: (p.detach() - initial[name]) for name, p in pipe.named_parameters()}
    timed = times[2:] if len(times) > 2 else times
    tokens = user.BATCH * user.SEQ
    result = {"precision": precision, "fp8_recipe": recipe if precision == "fp8" else None,
              "split_s": round(split_s, 1), "step_time_s": round(statistics.median(timed), 5),
              "tokens_per_s": round(tokens / statistics.median(timed), 1),
              "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
              "losses": losses, "all_step_times_s": [round(t, 5) for t in times]}
    result["_first_grads"] = {k: v.cpu() for k, v in first_grads.items()}
    result["_moved"] = {k: v.cpu() for k, v in moved.items()}
    del pipe, optimizer, initial
    torch.cuda.empty_cache()
    return result


def compare(reference: dict, found: dict) -> dict:
    grads = {name: sqnr(reference["_first_grads"][name], grad) for name, grad in found["_first_grads"].items()}
    moved = {name: sqnr(reference["_moved"][name], delta) for name, delta in found["_moved"].items()}
    worst_grad, worst_moved = min(grads, key=grads.get), min(moved, key=moved.get)
    return {"against": "bf16", "criterion_db": SQNR_DB,
            "first_step_grad_sqnr_db_min": round(grads[worst_grad], 2), "worst_grad": worst_grad,
            "first_step_grad_sqnr_db_median": round(statistics.median(grads.values()), 2),
            "update_sqnr_db_min": round(moved[worst_moved], 2), "worst_update": worst_moved,
            "update_sqnr_db_median": round(statistics.median(moved.values()), 2),
            "loss_difference_max": max(abs(a - b) for a, b in zip(reference["losses"], found["losses"])),
            "within_torchao_tolerance": min(grads[worst_grad], moved[worst_moved]) > SQNR_DB,
            "step_time_over_bf16": round(found["step_time_s"] / reference["step_time_s"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="samples a step, in 2 microbatches")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--compile", action="store_true", help="torch.compile the stage (slower to start)")
    args = parser.parse_args()
    versions = _ensure_imports()
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device: fp8 needs a GPU of compute capability 8.9 or more", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "torch": torch.__version__, **versions, "settings": vars(args), "runs": [], "comparisons": {}}
    from tracepp.runtime.precision import fp8_problem

    problem = fp8_problem(torch.device("cuda"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        model_path = os.path.join(work, "fp8_step_model.py")
        with open(model_path, "w") as handle:
            handle.write(MODEL.format(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch))
        bf16 = run(model_path, work, "bf16", "tensorwise", args)
        runs = [bf16]
        if problem is None:
            for recipe in ("tensorwise", "rowwise"):
                try:
                    found = run(model_path, work, "fp8", recipe, args)
                except Exception as error:  # reported, the other recipe still runs
                    report["comparisons"][recipe] = {"error": f"{type(error).__name__}: {error}"}
                    continue
                runs.append(found)
                report["comparisons"][recipe] = compare(bf16, found)
        else:
            report["fp8_refused"] = problem
    report["runs"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    path = os.path.join(os.environ.get("OUT") or os.getcwd(), "fp8_step.json")
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"{report['device']} (capability {report['capability']}), torch {report['torch']}, torchao "
          f"{report['torchao']}; {args.layers} layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens a step")
    for item in report["runs"]:
        name = item["precision"] + (f" {item['fp8_recipe']}" if item["fp8_recipe"] else "")
        print(f"  {name:16s} step {item['step_time_s'] * 1000:8.1f} ms  {item['tokens_per_s']:10.0f} tok/s  peak "
              f"{item['peak_memory_gb']:6.2f} GB  losses {', '.join(f'{x:.4f}' for x in item['losses'])}")
    for recipe, found in report["comparisons"].items():
        if "error" in found:
            print(f"  fp8 {recipe}: FAILED {found['error']}")
            continue
        print(f"  fp8 {recipe} vs bf16: first-step gradients SQNR min {found['first_step_grad_sqnr_db_min']} dB "
              f"({found['worst_grad']}), parameter updates SQNR min {found['update_sqnr_db_min']} dB; within "
              f"torchao's {SQNR_DB:.0f} dB: {found['within_torchao_tolerance']}; step time x"
              f"{found['step_time_over_bf16']} of bf16")
    if "fp8_refused" in report:
        print(f"  fp8 refused: {report['fp8_refused']}")
    print(f"wrote {path} ({report['elapsed_s']} s)")
    failed = "fp8_refused" in report or any("error" in c or not c["within_torchao_tolerance"]
                                            for c in report["comparisons"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
