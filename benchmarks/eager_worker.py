"""Train a benchmark model eagerly, unsplit, in one process (the reference every pipeline is held to).

    python -m benchmarks.eager_worker --model-file m.py --steps 12 --metrics m.jsonl [--memory-dir DIR] [--device cpu]

Full batch at once: ``loss_fn(model(*args), target)``, ``backward``, SGD step, ``zero_grad``; the step time
is the wall time of those (CUDA synchronised at both ends), the batch built and moved before the clock
starts. One JSON line per step: ``step``, ``loss``, ``step_time_s``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.gpt_model import load_model_file
from benchmarks.memory import PeakMemory, cuda_device_or_die, write_memory


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-file", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics", required=True)
    parser.add_argument("--memory-dir", default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    device = cuda_device_or_die() if args.device == "cuda" else torch.device("cpu")
    user = load_model_file(args.model_file)
    model = user.model().to(device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    memory = PeakMemory(device) if args.memory_dir else None  # the last MEMORY_STEPS steps: untimed by the harness
    for step in range(args.steps):
        inputs, kwargs, target = user.batch(step)
        inputs = tuple(t.to(device) for t in inputs)
        kwargs = {k: v.to(device) for k, v in (kwargs or {}).items()}
        target = target.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if memory is not None:
            memory.at_step(step, args.steps)
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = user.loss_fn(model(*inputs, **kwargs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        cpu_time = time.process_time() - cpu_start
        with open(args.metrics, "a") as handle:
            handle.write(json.dumps({"step": step, "loss": float(loss.detach()), "step_time_s": elapsed,
                                     "cpu_time_s": cpu_time}) + "\n")
    if memory is not None:
        write_memory(args.memory_dir, 0, memory.stop())


if __name__ == "__main__":
    main()
