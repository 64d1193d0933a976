"""What a CUDA training rank holds beyond the tensors it allocates: the measurement behind the fit check's reserve.

    python3 benchmarks/cuda_reserve.py [--hidden 1024] [--seq 1024] [--steps 6]

Writes ``$OUT/cuda_reserve.json`` (else ``./cuda_reserve.json``) and prints a summary ending in the
``--memory-reserve`` this GPU suggests. Self-contained: one GPU, no internet, torch (2.11 or later), numpy and
transformers; ``tracepp`` is imported from this checkout even where it is not installed. About 2 minutes on an H200.

Three parts, each in processes of its own, so that one's allocations do not hide another's:

1. **The CUDA context** (a fresh process): the device memory this process holds (NVML's per-process figure, and
   ``mem_get_info``'s used memory) after CUDA starts and one tensor is allocated, less what the caching allocator
   reserved.
2. **NCCL's buffers** (the same process, then): a 1-rank NCCL process group, one small all_reduce (the communicator is
   made), then a send/recv-free warm-up (all_reduce of 64 MiB, all_gather_into_tensor, reduce_scatter_tensor,
   broadcast), then a second group (``new_group``) and its all_reduce: the device memory beyond the allocator's
   reserve after each, i.e. the first communicator and each further one (a pipeline rank makes several: the default
   group, each pipeline peer pair, dp, tp).
3. **The caching allocator's reserve above what it hands out** (fragmentation): a small tracepp-split model
   (``tests/models/memory_zoo.py``'s Llama at ``--hidden`` and ``--seq``, vocabulary 32000; ``--ranks 1 --stages 2
   --schedule interleaved-1f1b``, 4 microbatches, bf16, AdamW, ``--device cuda``) trained ``--steps`` steps through
   its rank script (``torchrun --nproc-per-node 1 out/run.py``), once without and once with selective checkpointing;
   after every step ``max_memory_reserved`` against ``max_memory_allocated``, the allocator's retries and inactive
   split bytes, and the device memory beyond the reserve (context, NCCL, library workspaces outside the allocator).
   The plan's predicted peak beside ``max_memory_allocated`` is the CUDA column of docs/memory.md's check.

The suggestion: NCCL's first communicator plus three more (a middle pipeline rank's two peers and one more group),
rounded up to 0.1 GB, plus the largest fragmentation share seen, rounded up to the next percent. The context is not
in it: the fit check reads free memory after CUDA started, which already leaves the context out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = os.path.join(REPO, "tests", "models", "memory_zoo.py")
DEADLINE_S = 170  # the whole script stays under 3 minutes


def _tracepp_path() -> str:
    """A folder that makes ``import tracepp`` (with tracepp.split, .codegen, .runtime) work from this checkout:
    the package is installed, or a folder of links laid out as pyproject's package-dir maps it."""
    probe = subprocess.run([sys.executable, "-c", "import tracepp.runtime, tracepp.codegen, tracepp.split"],
                           capture_output=True, cwd=tempfile.gettempdir())
    if probe.returncode == 0:
        return ""
    root = tempfile.mkdtemp(prefix="tracepp_path_")
    package = os.path.join(root, "tracepp")
    os.makedirs(package)
    for name in os.listdir(os.path.join(REPO, "tracepp")):
        os.symlink(os.path.join(REPO, "tracepp", name), os.path.join(package, name))
    for name in ("split", "codegen", "runtime"):
        os.symlink(os.path.join(REPO, name), os.path.join(package, name))
    return root


def _process_bytes(pid: int):
    """Device memory NVML attributes to ``pid`` (context, allocator, NCCL, workspaces), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("LOCAL_RANK", "0")))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001  (no NVML, or a container that hides pids: mem_get_info's figure stands)
        return None
    return None


def _device_state(torch) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    process = _process_bytes(os.getpid())
    return {"reserved": reserved, "allocated": torch.cuda.memory_allocated(), "used": total - free,
            "process": process, "total": total,
            # beyond the allocator: NVML's per-process figure where it has one, else the device's used memory
            "beyond_reserved": (process if process is not None else total - free) - reserved}


# -- parts 1 and 2: the context and NCCL (run as `--part nccl` in a fresh process) ----------------------------------

def context_and_nccl() -> dict:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    started = _device_state(torch)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    small = torch.ones(1024, device="cuda")
    dist.all_reduce(small)
    first = _device_state(torch)
    big = torch.ones(16 * 2**20, device="cuda")  # 64 MiB
    dist.all_reduce(big)
    out = torch.empty_like(big)
    dist.all_gather_into_tensor(out, big)
    dist.reduce_scatter_tensor(out, big)
    dist.broadcast(big, 0)
    del big, out
    torch.cuda.empty_cache()
    warmed = _device_state(torch)
    second_group = dist.new_group([0])
    dist.all_reduce(small, group=second_group)
    second = _device_state(torch)
    dist.destroy_process_group()
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "states": {"cuda_started": started, "nccl_first_all_reduce": first, "warmed_up": warmed,
                       "second_group": second},
            "context_bytes": started["beyond_reserved"],
            "nccl_first_communicator_bytes": first["beyond_reserved"] - started["beyond_reserved"],
            "nccl_warm_up_bytes": warmed["beyond_reserved"] - first["beyond_reserved"],
            "nccl_further_communicator_bytes": second["beyond_reserved"] - warmed["beyond_reserved"]}


# -- part 3: the rank script's steps (run as `--rank OUT RESULT -- run.py args` under torchrun) ---------------------

def rank_wrapper(folder: str, result: str, rest: list) -> None:
    """Run ``folder/run.py`` with ``rest``, recording the allocator's statistics at the end of every step."""
    import runpy

    import torch

    sys.path.insert(0, os.path.abspath(folder))
    import tracepp_runtime

    steps = []

    def at_step_end(pipe, step: int) -> None:
        if pipe.device.type != "cuda":
            steps.append({"step": step, "device": "cpu"})
            return
        stats = torch.cuda.memory_stats(pipe.device)
        state = _device_state(torch)
        steps.append({"step": step, "max_allocated": torch.cuda.max_memory_allocated(pipe.device),
                      "max_reserved": torch.cuda.max_memory_reserved(pipe.device),
                      "alloc_retries": stats.get("num_alloc_retries", 0),
                      "inactive_split_bytes": stats.get("inactive_split_bytes.all.current", 0), **state})

    tracepp_runtime.register_step_end_hook(at_step_end)
    sys.argv = [os.path.join(folder, "run.py")] + rest
    try:
        runpy.run_path(os.path.join(folder, "run.py"), run_name="__main__")
    finally:
        with open(result, "w") as handle:
            json.dump(steps, handle, indent=1)


def training(work: str, mode: str, hidden: int, seq: int, steps: int, env: dict, budget_s: float) -> dict:
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = os.path.join(work, f"out_{mode}")
    os.environ.update(MEMORY_FAMILY="llama", MEMORY_HIDDEN=str(hidden), MEMORY_SEQ=str(seq), MEMORY_VOCAB="32000")
    started = time.perf_counter()
    manifest = split_model(MODEL, out, schedule="interleaved-1f1b", num_stages=2, num_microbatches=4,
                           layout=Layout(pp=1),
                           run=RunOptions(precision="bf16", activation_checkpointing=mode, optimizer="adamw",
                                          device=device))
    split_s = time.perf_counter() - started
    result = os.path.join(work, f"steps_{mode}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.abspath(__file__), "--rank", out, result, "--", "--steps", str(steps), "--quiet"]
    run_env = dict(env, MEMORY_FAMILY="llama", MEMORY_HIDDEN=str(hidden), MEMORY_SEQ=str(seq), MEMORY_VOCAB="32000",
                   PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=run_env, timeout=max(budget_s, 10))
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "error": f"the run outlasted its {budget_s:.0f} s budget"}
    run_s = time.perf_counter() - started
    record = {"mode": mode, "ok": done.returncode == 0, "split_s": round(split_s, 1), "run_s": round(run_s, 1),
              "predicted_peak_bytes": manifest["memory"]["ranks"][0]["peak_bytes"],
              "predicted_at": manifest["memory"]["ranks"][0]["at"]}
    if done.returncode != 0:
        record["error"] = (done.stdout + done.stderr)[-3000:]
        return record
    with open(result) as handle:
        per_step = json.load(handle)
    record["steps"] = per_step
    cuda = [s for s in per_step if "max_allocated" in s]
    if cuda:
        last = cuda[-1]
        record.update(max_allocated=last["max_allocated"], max_reserved=last["max_reserved"],
                      fragmentation_share=(last["max_reserved"] - last["max_allocated"]) / last["max_allocated"],
                      beyond_reserved_bytes=max(s["beyond_reserved"] for s in cuda),
                      alloc_retries=last["alloc_retries"],
                      measured_over_predicted=last["max_allocated"] / record["predicted_peak_bytes"])
    return record


def suggest(nccl: dict, runs: list):
    """The ``--memory-reserve`` these figures give (see the module doc), or None without CUDA figures."""
    shares = [r["fragmentation_share"] for r in runs if r.get("fragmentation_share") is not None]
    if "nccl_first_communicator_bytes" not in nccl or not shares:
        return None
    communicators = (nccl["nccl_first_communicator_bytes"] + nccl["nccl_warm_up_bytes"]
                     + 3 * max(nccl["nccl_further_communicator_bytes"], 0))
    fixed_gb = math.ceil(max(communicators, 0) / 1e8) / 10
    percent = math.ceil(max(shares) * 100)
    return {"memory_reserve": f"{fixed_gb:g}GB+{percent}%", "communicators_bytes": communicators,
            "fragmentation_share": max(shares)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--part"]:
        print(json.dumps(context_and_nccl()))
        return 0
    if argv[:1] == ["--rank"]:
        cut = argv.index("--")
        rank_wrapper(argv[1], argv[2], argv[cut + 1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=os.environ.get("OUT") or os.getcwd())
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    extra = _tracepp_path()
    env = dict(os.environ)
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH")) if p)
        sys.path.insert(0, extra)
    part = subprocess.run([sys.executable, os.path.abspath(__file__), "--part"], capture_output=True, text=True,
                          env=env, timeout=90)
    try:
        nccl = json.loads(part.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        nccl = {"error": (part.stdout + part.stderr)[-3000:]}
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for mode in ("none", "selective"):
            left = DEADLINE_S - (time.perf_counter() - begun)
            if left < 30:
                runs.append({"mode": mode, "ok": False, "error": f"skipped: {left:.0f} s of the budget left"})
                continue
            runs.append(training(work, mode, args.hidden, args.seq, args.steps, env, left - 5))
    result = {"script": "benchmarks/cuda_reserve.py", "hidden": args.hidden, "seq": args.seq, "steps": args.steps,
              "context_and_nccl": nccl, "training": runs, "suggestion": suggest(nccl, runs),
              "wall_s": round(time.perf_counter() - begun, 1)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cuda_reserve.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)
    gb = 1e9
    if "context_bytes" in nccl:
        print(f"{nccl['device']}, torch {nccl['torch']}, NCCL {nccl['nccl']}: context "
              f"{nccl['context_bytes'] / gb:.3f} GB; NCCL first communicator "
              f"{nccl['nccl_first_communicator_bytes'] / gb:.3f} GB, warm-up {nccl['nccl_warm_up_bytes'] / gb:.3f} GB, "
              f"each further {nccl['nccl_further_communicator_bytes'] / gb:.3f} GB")
    else:
        print(f"context and NCCL: {nccl.get('skipped') or nccl.get('error')}")
    for run in runs:
        if run.get("max_allocated"):
            print(f"training ({run['mode']}): max allocated {run['max_allocated'] / gb:.3f} GB (plan "
                  f"{run['predicted_peak_bytes'] / gb:.3f} GB, ratio {run['measured_over_predicted']:.3f}), "
                  f"max reserved {run['max_reserved'] / gb:.3f} GB (+{run['fragmentation_share'] * 100:.1f}%), "
                  f"beyond the reserve {run['beyond_reserved_bytes'] / gb:.3f} GB, allocator retries "
                  f"{run['alloc_retries']}")
        else:
            outcome = "ok (no CUDA figures)" if run.get("ok") else run.get("error", "")[-500:]
            print(f"training ({run['mode']}): {outcome}")
    print(f"suggested --memory-reserve: {(result['suggestion'] or {}).get('memory_reserve')}; wrote {path} in "
          f"{result['wall_s']} s")
    return 0 if all(run.get("ok") for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
