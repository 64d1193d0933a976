"""The generated rank scripts call :func:`main`: set up the process group, load this rank's stages, train.

Command line (the same on every rank, as torchrun passes it)::

    torchrun --nproc-per-node R out/run.py [--steps K] [--lr LR] [--save ckpt.pt] [--metrics m.jsonl]
                                           [--timeout SECONDS] [--load CKPT | --init model|per-module]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .executor import RankExecutor
from .failure import EXIT_FAILED, FailureChannel, PipelineError
from .batching import BatchChecker
from .weights import INIT_MODES, load_rank_state


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train this pipeline (run under torchrun).")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of the default SGD optimizer")
    parser.add_argument("--save", default=None, help="write the trained state_dict (original FQNs) here")
    parser.add_argument("--metrics", default=None, help="append one JSON line per step here")
    parser.add_argument("--load", default=None,
                        help="initial weights: a .safetensors or torch state_dict file, a Hugging Face folder, or a "
                             "torch.distributed.checkpoint folder, keyed by the model's FQNs; each rank reads its own")
    parser.add_argument("--init", default="model", choices=INIT_MODES,
                        help="without --load: 'model' builds model() and keeps this rank's tensors (equals eager); "
                             "'per-module' initialises only this rank's modules, seeded by FQN (large models)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any communication may wait before the job fails (default 120)")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    return parser.parse_args(argv)


def load_user_module(folder: str):
    """Import the model file copied into the output folder (it defines loss_fn, batch, optimizer)."""
    try:
        import tracepp  # noqa: F401  the model file may call tracepp.pipe_split()
    except ImportError:  # tracepp is not installed here: its marker lives in this runtime
        from . import markers

        shim = types.ModuleType("tracepp")
        shim.pipe_split = markers.pipe_split
        sys.modules["tracepp"] = shim
    path = os.path.join(folder, "model_file.py")
    spec = importlib.util.spec_from_file_location("tracepp_model_file", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def load_spec(manifest: dict, key: str):
    """A pytree spec from the manifest: JSON where torch can serialise it, else a pickle (model-output classes)."""
    if manifest.get(key):
        return pytree.treespec_loads(manifest[key])
    if manifest.get(key + "_pickle"):
        import base64
        import pickle

        return pickle.loads(base64.b64decode(manifest[key + "_pickle"]))
    return None


def launch(folder: str) -> None:
    """run.py's body: check the world size on every rank, then run this rank's script."""
    import runpy

    with open(os.path.join(folder, "manifest.json")) as handle:
        manifest = json.load(handle)
    rank = int(os.environ.get("RANK", "0"))
    try:
        check_world_size(manifest)
    except PipelineError as error:
        print(f"[tracepp rank {rank}] error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    runpy.run_path(os.path.join(folder, f"rank{rank}.py"), run_name="__main__")


def check_world_size(manifest: dict) -> None:
    expected = manifest["plan"]["num_ranks"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != expected:
        raise PipelineError(
            f"this pipeline was planned for {expected} ranks but torchrun started {world}: "
            f"run `{manifest['launch_command']}`, "
            f"or re-split with `tracepp split ... --ranks {world}`"
        )


def _init_process_group(rank: int, world: int, timeout_s: float):
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world > 1 or "MASTER_ADDR" in os.environ:
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    return device, backend


def _shared_groups(manifest: dict, rank: int, state: dict):
    """One process group per set of ranks that hold copies of a shared parameter, in the same order everywhere."""
    by_ranks: dict = {}
    for shared in manifest["shared"]:
        ranks = sorted({manifest["plan"]["stage_to_rank"][s] for s in shared["stages"]})
        if len(ranks) > 1:
            by_ranks.setdefault(tuple(ranks), []).append(shared["fqn"])
    groups = []
    for ranks, fqns in sorted(by_ranks.items()):
        group = dist.new_group(list(ranks))  # every rank calls new_group for every set, in sorted order
        if rank in ranks:
            groups.append((group, [state[f] for f in fqns if f in state and isinstance(state[f], torch.nn.Parameter)]))
    return groups


def _sync_shared_grads(groups: list) -> None:
    for group, params in groups:
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _save(path: str, manifest: dict, folder: str, rank: int, state: dict, world: int) -> None:
    """Gather every rank's state and write one state_dict (original FQNs) atomically from rank 0."""
    mine = {}
    for spec in manifest["stages"]:
        if manifest["plan"]["stage_to_rank"][spec["index"]] != rank:
            continue
        for ref in spec["state"]:
            if ref["kind"] != "constant" and ref.get("persistent", True):
                mine[ref["fqn"]] = state[ref["fqn"]].detach().cpu()
    parts = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(mine, parts, dst=0, group=_control_group())
    else:
        parts = [mine]
    if rank != 0:
        return
    # state no stage reads never changes: rank 0 materialised it at start-up (runtime/weights.py)
    merged = {item["fqn"]: state[item["fqn"]].detach().cpu() for item in manifest.get("unused_state", [])}
    for part in parts:
        merged.update(part)
    aliases = {ref["fqn"]: ref["aliases"] for spec in manifest["stages"] for ref in spec["state"]}
    result = {}
    for fqn in manifest["state_dict_keys"]:
        canonical = next((c for c, names in aliases.items() if fqn in names and c in merged), fqn)
        result[fqn] = merged[canonical]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    torch.save(result, temporary)
    os.replace(temporary, path)  # never leave a half-written checkpoint at `path`


_CONTROL = None


def _control_group():
    global _CONTROL
    if _CONTROL is None:
        _CONTROL = dist.new_group(backend="gloo")
    return _CONTROL


def _format_table(rows: list, headers: list) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line, rule] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells])


def main(rank_script_rank: int, stage_functions: dict, actions: list, folder: str, shapes=None, argv=None) -> None:
    args = parse_args(argv)
    with open(os.path.join(folder, "manifest.json")) as handle:
        manifest = json.load(handle)
    rank = int(os.environ.get("RANK", str(rank_script_rank)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    channel = FailureChannel(rank, world, args.timeout)
    channel.start_watchdog()
    try:
        check_world_size(manifest)
        _train(args, manifest, folder, rank, world, stage_functions, actions, shapes)
    except PipelineError as error:
        channel.report(str(error))
        _exit(EXIT_FAILED)
    except Exception as error:  # an unexpected failure: keep the traceback, and tell every rank
        cause = channel.peer_failure()
        if cause is not None:  # our error is the echo of a peer's crash (e.g. "connection closed by peer")
            print(f"[tracepp rank {rank}] stopping because {cause}", file=sys.stderr, flush=True)
            _exit(EXIT_FAILED)
        traceback.print_exc()
        channel.report(f"{type(error).__name__}: {error}")
        _exit(EXIT_FAILED)
    channel.stop()


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on peers that may be blocked: the watchdog tells them


def _train(args, manifest, folder, rank, world, stage_functions, actions, shapes=None) -> None:
    device, backend = _init_process_group(rank, world, args.timeout)
    user = load_user_module(folder)
    training = manifest["training"]
    out_spec = load_spec(manifest, "out_spec")
    state = load_rank_state(folder, manifest, rank, device, user, load=args.load, init=args.init)
    loss_fn = getattr(user, "loss_fn", None) if training else None
    executor = RankExecutor(manifest, rank, stage_functions, actions, state, device, loss_fn, args.timeout,
                            out_spec, training, shapes)
    checker = BatchChecker(manifest)
    groups = _shared_groups(manifest, rank, state) if world > 1 else []
    params = [t for t in state.values() if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    optimizer = None
    if training and params:
        make = getattr(user, "optimizer", None)
        optimizer = make(params) if make is not None else torch.optim.SGD(params, lr=args.lr)
    reports_loss = manifest["plan"]["stage_to_rank"][-1] == rank
    history = []
    for step in range(args.steps):
        batch = user.batch(step) if hasattr(user, "batch") else (
            user.example_inputs(), user.example_kwargs() if hasattr(user, "example_kwargs") else {},
            user.example_target() if training else None)
        inputs, kwargs, target = batch if len(batch) == 3 else (*batch, None)
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        mb = checker.microbatches(step, inputs, kwargs, target, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = executor.run_step(mb.leaves, mb.targets, mb.scales, mb.symbols)
        if training:
            _sync_shared_grads(groups)
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if reports_loss:
            loss = float(result) if training else None
            samples = mb.batch_size
            history.append((step, loss, elapsed, samples / elapsed))
            if not args.quiet:
                text = f"loss {loss:.6f} | " if loss is not None else ""
                print(f"step {step + 1}/{args.steps} | {text}{elapsed * 1000:.1f} ms | "
                      f"{samples / elapsed:.1f} samples/s", flush=True)
            if args.metrics:
                with open(args.metrics, "a") as handle:
                    handle.write(json.dumps({"step": step, "loss": loss, "step_time_s": elapsed,
                                             "samples_per_s": samples / elapsed, "batch_size": samples}) + "\n")
    if args.save:
        _save(args.save, manifest, folder, rank, state, world)
    if world > 1:
        dist.barrier(group=_control_group())
    if reports_loss and history and not args.quiet:
        times = sorted(h[2] for h in history)
        rows = [["steps", len(history)], ["first loss", f"{history[0][1]:.6f}" if training else "-"],
                ["last loss", f"{history[-1][1]:.6f}" if training else "-"],
                ["median step time (ms)", f"{times[len(times) // 2] * 1000:.1f}"],
                ["samples/s (median)", f"{sorted(h[3] for h in history)[len(history) // 2]:.1f}"],
                ["ranks / stages", f"{world} / {len(manifest['stages'])}"],
                ["schedule", manifest["plan"]["schedule"]], ["microbatches", manifest["plan"]["num_microbatches"]],
                ["backend", backend]]
        print(_format_table(rows, ["summary", "value"]), flush=True)
        if args.save:
            print(f"saved {args.save}", flush=True)
    if world > 1:
        dist.destroy_process_group()
