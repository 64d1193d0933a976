"""One tracepp stage's training step on one GPU at bf16 and at fp8 (torchao's float8, tensorwise and rowwise): step
time, and the fp8 gradients and parameters against the bf16 run's within the tolerance torchao documents.

Run from the repository root on a machine with one GPU of compute capability 8.9 or more, torch >= 2.11 and
(optionally carried) torchao::

    python benchmarks/fp8_step.py [--steps 6] [--layers 4] [--hidden 2048] [--seq 2048] [--compile] [--also-compile]

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

To tell tracepp's fp8 path from torchao's own float8 numerics on this model (random weights, a near-uniform loss:
small noisy gradients), the same model also runs without tracepp (``torchao_reference``): the model file's
``model()`` with its parameters cast to bf16 as the params policy casts them (buffers stay fp32), in bf16 ("eager")
and with torchao's ``convert_to_float8_training`` (the recipe's ``Float8LinearConfig``, the linears tracepp's
``fp8_eligible`` takes), the same batches in the same 2 microbatches, the first step's gradients accumulated in
fp32. Per recipe: ``torchao_grad_sqnr_db_min/median`` (torchao fp8 against eager bf16, as tracepp fp8 against
tracepp bf16), ``tracepp_vs_torchao_grad_sqnr_db_min/median`` (tracepp's fp8 gradients against torchao's: the
same numerics, so they should agree far better than either agrees with bf16), and ``torchao_step_ms_bf16/fp8``
(forward and backward only); ``torchao_reference.bf16`` has tracepp bf16 against eager bf16 (the baseline's check).
``--compile`` compiles tracepp's stage and the reference model; ``--also-compile`` times bf16 and fp8 again compiled
after the eager runs (``--compiled-steps``, 6: tracepp's three runs, then torchao's while the elapsed time stays
under ``--budget-s``, 240 s): ``step_ms_compiled`` per run, ``step_ms_compiled_bf16/fp8`` per recipe, details
under ``compiled_repeat``.
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
MICROBATCHES = 2  # the split's microbatches a step; the torchao reference cuts each batch the same way

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


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device) -> float:
    if device.type != "cuda":
        return 0.0
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def run(model_path: str, work: str, precision: str, recipe: str, args, device_name: str = "cuda",
        compile: bool = None, steps: int = None, keep: bool = True) -> dict:
    """Split for ``precision`` and train ``args.steps`` steps through the Pipeline API on the GPU. ``compile``,
    ``steps``: instead of ``args.compile``, ``args.steps`` (the compiled repeat); ``keep``: keep the first step's
    gradients and the parameters' movement (for the SQNRs). A folder this precision was split into before is
    reused (the compile option is the Pipeline's, not the split's)."""
    import torch

    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.pipeline import Pipeline
    from tracepp.runtime.run_options import RunOptions

    sys.path.insert(0, os.path.dirname(model_path))
    import fp8_step_model as user

    compile = args.compile if compile is None else compile
    steps = args.steps if steps is None else steps
    out = os.path.join(work, f"{precision}_{recipe}")
    started = time.perf_counter()
    if not os.path.exists(os.path.join(out, "manifest.json")):
        split_model(model_path, out, num_stages=1, schedule="1f1b", num_microbatches=MICROBATCHES,
                    layout=Layout(pp=1), run=RunOptions(precision=precision, fp8_recipe=recipe, device="cuda"))
    split_s = time.perf_counter() - started
    device = torch.device(device_name)
    if compile:
        torch._dynamo.reset()
    pipe = Pipeline(out, all_stages=True, device=device, compile=compile)
    initial = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    _reset_peak(device)
    times, losses, first_grads = [], [], None
    for step in range(steps):
        inputs, kwargs, target = user.batch(step)
        _sync(device)
        start = time.perf_counter()
        loss = pipe.step(inputs, kwargs, target)
        if step == 0 and keep:  # the gradients of the same weights and data: torchao's criterion
            first_grads = {name: p.grad.detach().clone() for name, p in pipe.named_parameters() if p.grad is not None}
        optimizer.step()
        pipe.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    timed = times[2:] if len(times) > 2 else times
    tokens = user.BATCH * user.SEQ
    result = {"precision": precision, "fp8_recipe": recipe if precision == "fp8" else None, "compiled": compile,
              "split_s": round(split_s, 1), "step_time_s": round(statistics.median(timed), 5),
              "step_ms": round(statistics.median(timed) * 1000, 2),
              "tokens_per_s": round(tokens / statistics.median(timed), 1),
              "peak_memory_gb": _peak_gb(device),
              "losses": losses, "all_step_times_s": [round(t, 5) for t in times],
              "wall_s": round(time.perf_counter() - started, 1)}
    if keep:
        moved = {name: (p.detach() - initial[name]) for name, p in pipe.named_parameters()}
        result["_first_grads"] = {k: v.cpu() for k, v in first_grads.items()}
        result["_moved"] = {k: v.cpu() for k, v in moved.items()}
    del pipe, optimizer, initial
    torch.cuda.empty_cache()
    return result


def fp8_filter(module, fqn: str) -> bool:
    """torchao's ``module_filter_fn`` for the linears tracepp's fp8 runs in float8: every ``nn.Linear`` whose weight
    ``runtime/precision.fp8_eligible`` takes (2-D, both dims divisible by ``FP8_ALIGNMENT``, 16)."""
    import torch

    from tracepp.runtime.precision import fp8_eligible

    return isinstance(module, torch.nn.Linear) and fp8_eligible(module.weight)


def reference(model_path: str, precision: str, recipe: str, args, compile: bool = None, steps: int = None,
              keep: bool = True, device_name: str = "cuda", emulate: bool = False) -> dict:
    """The same model without tracepp: the model file's ``model()`` (same seed, same initial weights) on the GPU,
    its floating parameters cast to bf16 as the params policy casts them (``tracepp.trace.cast_parameters``:
    parameters only, buffers such as the rotary ``inv_freq`` stay fp32), for ``precision`` fp8 its linears swapped
    by torchao's ``convert_to_float8_training`` (the recipe's ``Float8LinearConfig``, :func:`fp8_filter`), optionally
    ``torch.compile``d; each step the model file's batch cut into ``MICROBATCHES`` with ``tensor_split`` as the
    Pipeline cuts it, the loss per microbatch the model file's ``loss_fn`` in fp32 times its share of the batch
    (as the executor weighs it), forward and backward. No optimizer: every step sees the initial weights, so only
    the first step's gradients (accumulated over the microbatches in fp32, as into tracepp's fp32 masters) and
    loss compare with tracepp's; the step time is forward and backward of both microbatches."""
    import torch

    sys.path.insert(0, os.path.dirname(model_path))
    import fp8_step_model as user

    compile = args.compile if compile is None else compile
    steps = args.steps if steps is None else steps
    device = torch.device(device_name)
    started = time.perf_counter()
    if compile:
        torch._dynamo.reset()
    model = user.model().to(device)
    model.train()
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != torch.bfloat16:
            param.data = param.data.to(torch.bfloat16)
    float8 = []
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def chosen(module, fqn):
            taken = fp8_filter(module, fqn)
            if taken:
                float8.append(fqn)
            return taken

        config = Float8LinearConfig.from_recipe_name(recipe)
        if emulate:  # torchao's high-precision emulation of the float8 matmuls (a check off the GPU)
            import dataclasses

            config = dataclasses.replace(config, emulate=True)
        model = convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    named = dict(model.named_parameters())  # the original FQNs (Float8Linear keeps the Linear's parameters)
    forward = torch.compile(model) if compile else model
    setup_s = time.perf_counter() - started
    _reset_peak(device)
    times, losses, first_grads = [], [], {}
    for step in range(steps):
        inputs, kwargs, target = user.batch(step)
        _sync(device)
        start = time.perf_counter()
        batch = target.shape[0]
        chunks = [x.to(device).tensor_split(MICROBATCHES) if isinstance(x, torch.Tensor) and x.dim() > 0
                  and x.shape[0] == batch else [x] * MICROBATCHES for x in inputs]
        targets = target.to(device).tensor_split(MICROBATCHES)
        total = None
        for mb in range(MICROBATCHES):
            output = forward(*[chunk[mb] for chunk in chunks], **(kwargs or {}))
            loss = user.loss_fn(output, targets[mb]).float() * (targets[mb].shape[0] / batch)
            loss.backward()
            del output
            total = loss.detach() if total is None else total + loss.detach()
            if step == 0 and keep:  # fp32 accumulation over the microbatches, as into tracepp's fp32 masters
                for name, param in named.items():
                    if param.grad is not None:
                        grad = param.grad.float()
                        first_grads[name] = grad if name not in first_grads else first_grads[name] + grad
                        param.grad = None
        for param in named.values():
            param.grad = None
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(total))
        if step == 0 and keep:
            first_grads = {name: grad.cpu() for name, grad in first_grads.items()}
    timed = times[2:] if len(times) > 2 else times
    result = {"kind": "torchao" if precision == "fp8" else "eager", "precision": precision,
              "fp8_recipe": recipe if precision == "fp8" else None, "compiled": compile,
              "float8_linears": len(float8), "setup_s": round(setup_s, 1),
              "step_ms": round(statistics.median(timed) * 1000, 2),
              "peak_memory_gb": _peak_gb(device),
              "losses": losses, "all_step_times_s": [round(t, 5) for t in times],
              "wall_s": round(time.perf_counter() - started, 1)}
    if keep:
        result["_first_grads"] = first_grads
    del model, forward, named
    if compile:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def match_names(names, reference_names) -> dict:
    """name -> the reference's name for the same parameter: the same FQN (the Pipeline registers the original
    FQNs), else with a compiled module's ``_orig_mod.`` dropped, else the one reference name it ends with (or that
    ends with it); names with no single match are left out."""
    reference_names = list(reference_names)
    known = set(reference_names)
    found = {}
    for name in names:
        bare = name.replace("_orig_mod.", "")
        if name in known:
            found[name] = name
        elif bare in known:
            found[name] = bare
        else:
            ends = [r for r in reference_names if r.replace("_orig_mod.", "").endswith("." + bare)
                    or bare.endswith("." + r.replace("_orig_mod.", ""))]
            if len(ends) == 1:
                found[name] = ends[0]
    return found


def grad_sqnrs(reference_grads: dict, found_grads: dict, prefix: str) -> dict:
    """SQNR (dB) of ``found_grads`` against ``reference_grads`` per parameter, both in fp32: min (and which),
    median, how many compared and which found the reference lacks, under keys starting ``prefix``."""
    pairs = match_names(found_grads, reference_grads)
    values = {name: sqnr(reference_grads[pairs[name]].float(), found_grads[name].float()) for name in pairs}
    missing = sorted(set(found_grads) - set(pairs))
    if not values:
        return {f"{prefix}_error": f"no parameter names matched ({len(found_grads)} found, "
                                   f"{len(reference_grads)} in the reference)"}
    worst = min(values, key=values.get)
    return {f"{prefix}_min": round(values[worst], 2), f"{prefix}_median": round(statistics.median(values.values()), 2),
            f"{prefix}_worst": worst, f"{prefix}_compared": len(values),
            **({f"{prefix}_unmatched": missing} if missing else {})}


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


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def _label(precision: str, recipe: str) -> str:
    return "bf16" if precision == "bf16" else recipe


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="samples a step, in 2 microbatches")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the stage and the torchao reference model (slower to start)")
    parser.add_argument("--also-compile", action="store_true",
                        help="after the eager runs, time bf16 and fp8 again compiled: tracepp's stage, then "
                             "torchao's reference while --budget-s allows (step_ms_compiled)")
    parser.add_argument("--compiled-steps", type=int, default=6,
                        help="steps of each --also-compile run (at most --steps; the median is over those after "
                             "the first two)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="--also-compile: skip a compiled torchao reference run when the elapsed time plus the "
                             "last compiled run's wall time would pass this many seconds")
    args = parser.parse_args()
    versions = _ensure_imports()
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device: fp8 needs a GPU of compute capability 8.9 or more", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "torch": torch.__version__, **versions, "settings": vars(args), "runs": [], "comparisons": {},
              "torchao_reference": {}}
    from tracepp.runtime.precision import fp8_problem

    problem = fp8_problem(torch.device("cuda"))
    recipes = ("tensorwise", "rowwise") if problem is None else ()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        model_path = os.path.join(work, "fp8_step_model.py")
        with open(model_path, "w") as handle:
            handle.write(MODEL.format(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch))
        bf16 = run(model_path, work, "bf16", "tensorwise", args)
        runs, by_recipe = [bf16], {}
        if problem is None:
            for recipe in recipes:
                try:
                    found = run(model_path, work, "fp8", recipe, args)
                except Exception as error:  # reported, the other recipe still runs
                    report["comparisons"][recipe] = {"error": f"{type(error).__name__}: {error}"}
                    continue
                runs.append(found)
                by_recipe[recipe] = found
                report["comparisons"][recipe] = compare(bf16, found)
        else:
            report["fp8_refused"] = problem

        # torchao's own float8 on the same model, weights, batches and bf16 policy, and the same model in bf16
        refs = {}
        for precision, recipe in [("bf16", "tensorwise")] + [("fp8", r) for r in recipes]:
            try:
                refs[_label(precision, recipe)] = reference(model_path, precision, recipe, args)
            except Exception as error:
                report["torchao_reference"][_label(precision, recipe)] = {"error": f"{type(error).__name__}: {error}"}
        eager_bf16 = refs.get("bf16")
        if eager_bf16 is not None:  # the baseline's own check: tracepp bf16 against the eager bf16 model
            entry = _public(eager_bf16)
            entry.update(grad_sqnrs(eager_bf16["_first_grads"], bf16["_first_grads"],
                                    "tracepp_bf16_vs_eager_bf16_grad_sqnr_db"))
            entry["tracepp_bf16_vs_eager_bf16_loss0_difference"] = abs(bf16["losses"][0] - eager_bf16["losses"][0])
            report["torchao_reference"]["bf16"] = entry
        for recipe in recipes:
            ref = refs.get(recipe)
            comparison = report["comparisons"].setdefault(recipe, {})
            if ref is None:
                comparison["torchao_error"] = report["torchao_reference"].get(recipe, {}).get("error", "not run")
                continue
            report["torchao_reference"][recipe] = _public(ref)
            if eager_bf16 is not None:  # torchao fp8 against eager bf16, as tracepp fp8 against tracepp bf16
                comparison.update(grad_sqnrs(eager_bf16["_first_grads"], ref["_first_grads"], "torchao_grad_sqnr_db"))
                comparison["torchao_step_ms_bf16"] = eager_bf16["step_ms"]
            comparison["torchao_step_ms_fp8"] = ref["step_ms"]
            comparison["torchao_step_time_over_bf16"] = _ratio(ref["step_ms"], comparison.get("torchao_step_ms_bf16"))
            found = by_recipe.get(recipe)
            if found is not None:  # the same fp8 numerics, one through tracepp, one through torchao's modules
                comparison.update(grad_sqnrs(ref["_first_grads"], found["_first_grads"],
                                             "tracepp_vs_torchao_grad_sqnr_db"))
                comparison["tracepp_vs_torchao_loss0_difference"] = abs(found["losses"][0] - ref["losses"][0])
        for result in runs:
            result["step_ms_compiled"] = result["step_ms"] if args.compile else None
        for key, ref in refs.items():
            report["torchao_reference"][key]["step_ms_compiled"] = ref["step_ms"] if args.compile else None
        del refs, eager_bf16
        for result in runs:  # the tensors are compared: free them before the compiled repeat
            result.pop("_first_grads", None), result.pop("_moved", None)

        # the step times again with torch.compile
        if args.also_compile:
            steps = min(args.steps, args.compiled_steps)
            repeat = {"steps": steps, "runs": [], "skipped": [], "errors": []}
            if args.compile:
                repeat["note"] = "--compile: the runs above are compiled already; nothing repeated"
            else:
                repeat["note"] = (f"{steps} steps a compiled run (step time: median after the first two); tracepp "
                                  f"first, torchao's reference while the elapsed time stays under {args.budget_s:g} s")
                plan = [("tracepp", "bf16", "tensorwise")] + [("tracepp", "fp8", r) for r in recipes]
                plan += [("torchao", "bf16", "tensorwise")] + [("torchao", "fp8", r) for r in recipes]
                last_wall = 0.0
                for kind, precision, recipe in plan:
                    name = f"{kind} {_label(precision, recipe)}"
                    elapsed = time.perf_counter() - started
                    if kind == "torchao" and elapsed + last_wall > args.budget_s:
                        repeat["skipped"].append(f"{name}: {elapsed:.0f} s elapsed + ~{last_wall:.0f} s a compiled "
                                                 f"run > --budget-s {args.budget_s:g}")
                        continue
                    try:
                        if kind == "tracepp":
                            done = run(model_path, work, precision, recipe, args, compile=True, steps=steps,
                                       keep=False)
                        else:
                            done = reference(model_path, precision, recipe, args, compile=True, steps=steps,
                                             keep=False)
                    except Exception as error:
                        repeat["errors"].append(f"{name}: {type(error).__name__}: {error}")
                        torch._dynamo.reset()
                        torch.cuda.empty_cache()
                        continue
                    last_wall = done["wall_s"]
                    done["kind"] = kind if kind == "tracepp" else done["kind"]
                    repeat["runs"].append(_public(done))
                    if kind == "tracepp":
                        for result in runs:
                            if _label(result["precision"], result["fp8_recipe"] or "") == _label(precision, recipe):
                                result["step_ms_compiled"] = done["step_ms"]
                    elif _label(precision, recipe) in report["torchao_reference"]:
                        report["torchao_reference"][_label(precision, recipe)]["step_ms_compiled"] = done["step_ms"]
            report["compiled_repeat"] = repeat

        # step times side by side, per recipe
        eager_ref = report["torchao_reference"].get("bf16", {})
        for recipe in recipes:
            comparison = report["comparisons"][recipe]
            found = by_recipe.get(recipe)
            ref = report["torchao_reference"].get(recipe, {})
            comparison["step_ms_bf16"] = bf16["step_ms"]
            comparison["step_ms_fp8"] = found["step_ms"] if found else None
            comparison["step_ms_compiled_bf16"] = bf16.get("step_ms_compiled")
            comparison["step_ms_compiled_fp8"] = found.get("step_ms_compiled") if found else None
            comparison["compiled_step_time_over_bf16"] = _ratio(comparison["step_ms_compiled_fp8"],
                                                                comparison["step_ms_compiled_bf16"])
            comparison["torchao_step_ms_compiled_bf16"] = eager_ref.get("step_ms_compiled")
            comparison["torchao_step_ms_compiled_fp8"] = ref.get("step_ms_compiled")
            comparison["torchao_compiled_step_time_over_bf16"] = _ratio(
                comparison["torchao_step_ms_compiled_fp8"], comparison["torchao_step_ms_compiled_bf16"])
    report["runs"] = [_public(r) for r in runs]
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
    eager_ref = report["torchao_reference"].get("bf16", {})
    if "error" in eager_ref:
        print(f"  eager bf16 reference: FAILED {eager_ref['error']}")
    elif eager_ref:
        print(f"  bf16 check: tracepp bf16 vs eager bf16 grads SQNR min/median "
              f"{_pair(eager_ref, 'tracepp_bf16_vs_eager_bf16_grad_sqnr_db')} dB, first loss differs by "
              f"{eager_ref['tracepp_bf16_vs_eager_bf16_loss0_difference']:.2e}")
    for recipe in recipes:
        c = report["comparisons"][recipe]
        if "torchao_error" in c:
            print(f"  fp8 {recipe} torchao reference: FAILED {c['torchao_error']}")
        print(f"  SUMMARY fp8 {recipe}: grads vs bf16 SQNR min/median: tracepp "
              f"{_pair(c, 'first_step_grad_sqnr_db')} dB, torchao {_pair(c, 'torchao_grad_sqnr_db')} dB; tracepp vs "
              f"torchao {_pair(c, 'tracepp_vs_torchao_grad_sqnr_db')} dB (loss0 diff "
              f"{_num(c.get('tracepp_vs_torchao_loss0_difference'), '.2e')}); step ms bf16/fp8: tracepp eager "
              f"{_num(c.get('step_ms_bf16'))}/{_num(c.get('step_ms_fp8'))} compiled "
              f"{_num(c.get('step_ms_compiled_bf16'))}/{_num(c.get('step_ms_compiled_fp8'))}; torchao fwd+bwd eager "
              f"{_num(c.get('torchao_step_ms_bf16'))}/{_num(c.get('torchao_step_ms_fp8'))} compiled "
              f"{_num(c.get('torchao_step_ms_compiled_bf16'))}/{_num(c.get('torchao_step_ms_compiled_fp8'))}")
    repeat = report.get("compiled_repeat")
    if repeat:
        print(f"  compiled repeat: {repeat['note']}")
        for line in repeat["skipped"]:
            print(f"    skipped {line}")
        for line in repeat["errors"]:
            print(f"    FAILED {line}")
    print(f"wrote {path} ({report['elapsed_s']} s)")
    failed = "fp8_refused" in report or any("error" in c or not c.get("within_torchao_tolerance", False)
                                            for c in report["comparisons"].values())
    return 1 if failed else 0


def _num(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _pair(entry: dict, prefix: str) -> str:
    return f"{_num(entry.get(prefix + '_min'), '.2f')}/{_num(entry.get(prefix + '_median'), '.2f')}"


if __name__ == "__main__":
    sys.exit(main())
