"""Real-size figures of issue 9, measured: planning Llama-7B/70B shapes on meta, and training from a checkpoint
with each rank holding only its own stages.

    python -m benchmarks.real_size plan [--cases 7b,70b] [--split auto|equal]   # wall time, peak RSS, out/ size
    python -m benchmarks.real_size load [--ranks 4]          # 551M Llama, 4 ranks, 1 step from a .safetensors

``plan`` runs ``tracepp split benchmarks/llama_shapes.py`` as a subprocess per case (HF ``LlamaForCausalLM``
from a config; 7B into 4 stages, 70B-shaped into 16), by default with no split option but ``--stages`` (the
automatic split of the decoder stack; ``--split equal``: explicit ``--split-points`` at equal layer counts),
records where each stage begins, and reads the child's peak RSS from ``os.wait4`` (``ru_maxrss``). ``load`` writes the 551M model's
``state_dict`` to a ``.safetensors`` file under ``/tmp``, splits it into 4 stages, runs one training step with
``--load`` under torchrun on gloo, and samples every rank's ``VmHWM`` (peak RSS) from ``/proc`` every 50 ms;
a run with ``--steps 0`` gives the peak of loading alone. Two baselines: the same sampling over an idle torchrun
job that imports torch and the model file (so transformers) and initialises gloo; and a training rank's own
fixed memory, the peak of the same job (same flags, 4 ranks, one step from a checkpoint) on the ``tiny`` shape
(hidden 64) minus that model's own weights, gradients and optimizer state: code pages of the kernels a step
runs, allocator arenas, gloo's buffers, Python objects, which a process that runs no step does not have.
A rank's budget is its stages' parameters x (weights + gradients + optimizer state: SGD keeps none, AdamW two
moments; ``--optimizer``) in fp32 plus that baseline. Files under ``/tmp`` are deleted afterwards. Results go to ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "llama_shapes.py")
LAYERS = {"7b": (32, 4), "70b": (80, 16), "500m": (16, 4), "tiny": (4, 4)}


def split_points(case: str) -> list:
    layers, stages = LAYERS[case]
    return [f"model.layers.{layers * s // stages}" for s in range(1, stages)]


def _env(case: str) -> dict:
    return dict(os.environ, TRACEPP_LLAMA=case, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def run_measured(command: list, env: dict) -> dict:
    """Wall time and peak RSS (ru_maxrss of this one child) of a subprocess."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({code}):\n{output[-4000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2), "output": output}


def plan(cases: list, root: str, split: str = "auto") -> list:
    rows = []
    for case in cases:
        layers, stages = LAYERS[case]
        out = os.path.join(root, f"out_{case}")
        command = [sys.executable, "-m", "tracepp", "split", MODEL, "-o", out, "--ranks", str(stages),
                   "--schedule", "1f1b", "--microbatches", "4"]
        if split == "equal":
            command += ["--split-points", ",".join(split_points(case))]
        result = run_measured(command, _env(case))
        with open(os.path.join(out, "manifest.json")) as handle:
            manifest = json.load(handle)
        params = sum(s["num_params"] for s in manifest["stages"])
        begins = [s["module_fqns"][0] if s["module_fqns"] else None for s in manifest["stages"]]
        row = {"case": case, "split": split, "stages": stages, "parameters": params, "wall_s": result["wall_s"],
               "peak_rss_gb": result["peak_rss_gb"], "out_mb": round(_folder_bytes(out) / 1e6, 2),
               "stage_first_modules": begins,
               "stage_params": [s["num_params"] for s in manifest["stages"]]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        shutil.rmtree(out)
    return rows


class RankPeaks:
    """Samples VmHWM (peak RSS) of every process below ``pid`` that has a RANK, every 50 ms."""

    def __init__(self, pid: int):
        self.pid, self.peaks, self.ranks = pid, {}, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _children(self) -> list:
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as handle:
                        parents[int(name)] = int(handle.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
        found, frontier = [], [self.pid]
        while frontier:
            parent = frontier.pop()
            kids = [p for p, pp in parents.items() if pp == parent]
            found += kids
            frontier += kids
        return found

    def _sample(self) -> None:
        for pid in self._children():
            try:
                if pid not in self.ranks:  # read until RANK shows: a just-forked child has its parent's environ
                    with open(f"/proc/{pid}/environ", "rb") as handle:
                        env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
                    if b"RANK" not in env:
                        continue
                    self.ranks[pid] = int(env[b"RANK"])
                rank = self.ranks[pid]
                with open(f"/proc/{pid}/status") as handle:
                    hwm = next(int(line.split()[1]) for line in handle if line.startswith("VmHWM"))
                self.peaks[rank] = max(self.peaks.get(rank, 0), hwm * 1024)
            except (OSError, StopIteration, ValueError):
                continue

    def _run(self) -> None:
        while not self.done.is_set():
            self._sample()
            time.sleep(0.05)

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        return {rank: round(peak / 1e9, 3) for rank, peak in sorted(self.peaks.items())}


BASELINE = """
import importlib.util, os, sys, time, torch, torch.distributed as dist
spec = importlib.util.spec_from_file_location("model_file", sys.argv[1])  # its imports (transformers) count
spec.loader.exec_module(importlib.util.module_from_spec(spec))
dist.init_process_group("gloo")
dist.barrier()
time.sleep(1.0)
dist.destroy_process_group()
"""


def torchrun_peaks(nproc: int, args: list, env: dict) -> tuple:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = RankPeaks(process.pid)
    output = process.stdout.read()
    process.wait()
    result = peaks.stop()
    if process.returncode != 0:
        raise RuntimeError(f"torchrun failed ({process.returncode}):\n{output[-4000:]}")
    return result, round(time.perf_counter() - start, 1), output


OPTIMIZER_STATE = {"sgd": 0, "adamw": 2}  # fp32 tensors of optimizer state per parameter (AdamW: two moments)


def _rank_shares(manifest: dict, ranks: int) -> dict:
    """rank -> bytes (GB) of its stages' parameters in fp32, a tensor two local stages share counted once."""
    share, stage_to_rank = {}, manifest["plan"]["stage_to_rank"]
    for rank in range(ranks):
        fqns = {}
        for stage in manifest["stages"]:
            if stage_to_rank[stage["index"]] == rank:
                fqns.update({ref["fqn"]: ref["numel"] for ref in stage["state"] if ref["kind"] == "parameter"})
        share[rank] = sum(fqns.values()) * 4 / 1e9
    return share


def _train_job(case: str, ranks: int, root: str, env: dict, step_args: list, loading_only: bool) -> dict:
    """Write ``case``'s state_dict as .safetensors, split it, train one step with --load: peaks per rank."""
    env = dict(env, TRACEPP_LLAMA=case)
    checkpoint = os.path.join(root, f"llama{case}.safetensors")
    write = ("import benchmarks.llama_shapes as m\nfrom safetensors.torch import save_file\n"
             f"save_file({{k: v.contiguous() for k, v in m.model().state_dict().items()}}, {checkpoint!r})\n")
    run_measured([sys.executable, "-c", write], dict(env, PYTHONPATH=os.path.dirname(HERE)))
    out = os.path.join(root, f"out_{case}")
    run_measured([sys.executable, "-m", "tracepp", "split", MODEL, "-o", out, "--ranks", str(ranks), "--schedule",
                  "1f1b", "--microbatches", "4", "--split-points", ",".join(split_points(case))], env)
    run = [os.path.join(out, "run.py"), "--load", checkpoint, "--timeout", "600"]
    loaded = torchrun_peaks(ranks, run + ["--steps", "0"], env)[0] if loading_only else None
    peaks, wall, output = torchrun_peaks(ranks, run + step_args, env)
    with open(os.path.join(out, "manifest.json")) as handle:
        manifest = json.load(handle)
    return {"share": _rank_shares(manifest, ranks), "loaded": loaded, "peaks": peaks, "wall": wall,
            "output": output, "parameters": sum(s["num_params"] for s in manifest["stages"]),
            "checkpoint_gb": round(os.path.getsize(checkpoint) / 1e9, 3)}


def load(ranks: int, root: str, allocator_threshold: int = 0, optimizer: str = "sgd",
         activation_checkpointing: str = "none", steps: int = 1) -> dict:
    """Peak RSS per rank of one step of the 551M Llama from a .safetensors file, against two budgets: the rank's
    weights + gradients + optimizer state plus (a) an idle process's RSS, (b) the RSS a training rank of the
    same architecture holds besides its tensors (the ``tiny`` shape's peak minus its own tensors)."""
    env = _env("500m")
    if allocator_threshold:
        # glibc raises its mmap threshold after large frees, so freed blocks stay in the heap and in RSS;
        # a fixed threshold returns them at once (run.py does so itself on CPU ranks: runtime/host_memory.py)
        env = dict(env, MALLOC_MMAP_THRESHOLD_=str(allocator_threshold))
    baseline_script = os.path.join(root, "baseline.py")
    with open(baseline_script, "w") as handle:
        handle.write(BASELINE)
    idle, _, _ = torchrun_peaks(ranks, [baseline_script, MODEL], env)
    # steps: 1 sees a stateful optimizer's state only at its end (created lazily at the first optimizer step);
    # from step 2 on, the state is held through forward and backward too (the steady state)
    step_args = ["--steps", str(steps), "--optimizer", optimizer, "--activation-checkpointing",
                 activation_checkpointing]
    state = 2 + OPTIMIZER_STATE[optimizer]  # weights, gradients and the optimizer's tensors per parameter
    tiny = _train_job("tiny", ranks, root, env, step_args, loading_only=False)
    training = {rank: round(tiny["peaks"][rank] - state * tiny["share"][rank], 3) for rank in range(ranks)}
    big = _train_job("500m", ranks, root, env, step_args, loading_only=True)
    rows = []
    for rank in range(ranks):
        tensors = state * big["share"][rank]
        rows.append({"rank": rank, "weights_gb": round(big["share"][rank], 3),
                     "tensors_gb": round(tensors, 3),  # weights + gradients + optimizer state
                     "baseline_idle_gb": idle[rank], "baseline_training_gb": training[rank],
                     "budget_idle_gb": round(tensors + idle[rank], 3),
                     "budget_training_gb": round(tensors + training[rank], 3),
                     "peak_rss_loading_only_gb": big["loaded"][rank], "peak_rss_gb": big["peaks"][rank],
                     "below_budget_idle": big["peaks"][rank] < tensors + idle[rank],
                     "below_budget_training": big["peaks"][rank] < tensors + training[rank]})
        print(json.dumps(rows[-1]), flush=True)
    return {"parameters": big["parameters"], "optimizer": optimizer, "steps": steps,
            "activation_checkpointing": activation_checkpointing,
            "malloc_mmap_threshold": allocator_threshold or "glibc default (dynamic)",
            "checkpoint_gb": big["checkpoint_gb"], "wall_s": big["wall"], "ranks": rows,
            "loss_line": [line for line in big["output"].splitlines() if "loss" in line][:1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["plan", "load"])
    parser.add_argument("--cases", default="7b,70b")
    parser.add_argument("--split", default="auto", choices=["auto", "equal"],
                        help="plan: automatic split (only --stages) or explicit split points at equal layer counts")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0,
                        help="load: set MALLOC_MMAP_THRESHOLD_ for the ranks (bytes; 0: glibc's default)")
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZER_STATE),
                        help="load: run.py's --optimizer for the step; the budget counts its state")
    parser.add_argument("--steps", type=int, default=1, help="load: training steps (2+: the steady state)")
    parser.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"],
                        help="load: run.py's --activation-checkpointing")
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="tracepp_real_size_", dir="/tmp")
    try:
        if args.what == "plan":
            result = {"plan": plan(args.cases.split(","), root, args.split)}
        else:
            result = {"load": load(args.ranks, root, args.malloc_mmap_threshold, args.optimizer,
                                   args.activation_checkpointing, args.steps)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_average"] = os.getloadavg()
    result["cpus"] = os.cpu_count()
    write_result(args.results, f"real_size_{args.what}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
