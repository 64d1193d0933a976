"""Does the generated folder train on a GPU unchanged, equal to eager training on that GPU?

    python -m benchmarks.cuda_path [--model FILE] [--stages 2 4 8] [--steps 3] [--json out.json]

The model is the benchmark GPT (benchmarks/gpt_model.py: d256, 8 blocks, untied head, split at block
boundaries for each stage count) unless ``--model`` names a model file. For each stage count: ``tracepp split --ranks 1 --stages S`` (one rank holds every stage, so one GPU runs the
whole pipeline through an NCCL process group of size 1), ``torchrun --nproc-per-node 1 out/run.py --save``,
then the unsplit model is trained eagerly on the same device with the same batches and optimizer, and the
largest parameter difference is reported. TF32 is off for both (``NVIDIA_TF32_OVERRIDE=0`` and torch's flags),
so fp32 results are comparable to the CPU suite's tolerance. On a machine without CUDA it runs on CPU/gloo.
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


def eager_train(path: str, steps: int, lr: float, device: torch.device) -> dict:
    from tracepp.modelfile import load_model_file

    model_file = load_model_file(path)
    module = model_file.module
    model = model_file.model().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = module.optimizer(params) if hasattr(module, "optimizer") else torch.optim.SGD(params, lr=lr)
    move = lambda tree: torch.utils._pytree.tree_map(  # noqa: E731
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)
    for step in range(steps):
        if hasattr(module, "batch"):
            args, kwargs, target = module.batch(step)
        else:
            args, kwargs, target = model_file.example_inputs(), model_file.example_kwargs(), module.example_target()
        loss = module.loss_fn(model(*move(tuple(args)), **move(dict(kwargs))), move(target))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def run_case(model: str, stages: int, schedule: str, microbatches: int, steps: int, lr: float, work: str) -> dict:
    out = os.path.join(work, f"out_s{stages}")
    env = dict(os.environ, NVIDIA_TF32_OVERRIDE="0", PYTHONUNBUFFERED="1")
    split = [sys.executable, "-m", "tracepp", "split", model, "-o", out, "--ranks", "1", "--stages", str(stages),
             "--schedule", schedule, "--microbatches", str(microbatches)]
    started = time.perf_counter()
    done = subprocess.run(split, capture_output=True, text=True, env=env)
    split_s = time.perf_counter() - started
    if done.returncode:
        return {"stages": stages, "ok": False, "error": (done.stdout + done.stderr)[-3000:]}
    saved = os.path.join(out, "trained.pt")
    metrics = os.path.join(out, "metrics.jsonl")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(out, "run.py"), "--steps", str(steps), "--lr", str(lr), "--save", saved, "--metrics", metrics]
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        return {"stages": stages, "ok": False, "error": (done.stdout + done.stderr)[-3000:]}
    pipelined = torch.load(saved, map_location="cpu", weights_only=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    eager = eager_train(model, steps, lr, device)
    worst = max((pipelined[k].float() - eager[k].float()).abs().max().item() for k in eager)
    with open(metrics) as handle:
        lines = [json.loads(line) for line in handle]
    return {"stages": stages, "schedule": schedule, "microbatches": microbatches, "ok": True,
            "max_abs_diff_vs_eager": worst, "split_s": round(split_s, 2),
            "step_time_s": [round(line["step_time_s"], 5) for line in lines],
            "backend_line": next((l for l in done.stdout.splitlines() if "backend" in l), "")}


def _benchmark_gpt(work: str, num_stages: int) -> str:
    from benchmarks.gpt_model import GPTConfig, write_model_file

    return write_model_file(os.path.join(work, f"gpt_s{num_stages}.py"), GPTConfig(d_model=256, n_layer=8),
                            num_stages=num_stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model file (default: the benchmark GPT, d256, 8 blocks)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "model": args.model or "benchmarks.gpt_model d256 l8", "cases": []}
    with tempfile.TemporaryDirectory() as work:
        for stages in args.stages:
            model = os.path.abspath(args.model) if args.model else _benchmark_gpt(work, stages)
            case = run_case(model, stages, args.schedule, args.microbatches, args.steps,
                            args.lr, work)
            results["cases"].append(case)
            print(json.dumps(case), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
