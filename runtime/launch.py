"""The training loop of the generated ``run.py``, built on the public step API (:class:`pipeline.Pipeline`).

The rank scripts call :func:`main`: parse the flags, build this rank's Pipeline, then per step call
``batch(step)``, ``Pipeline.step``, sync shared gradients, check the global gradient norm (clipping and
non-finite handling), scale for fp16, step the optimizer, print and write metrics; ``--save`` at the end.

Command line (the same on every rank, as torchrun passes it)::

    torchrun --nproc-per-node R out/run.py [--steps K] [--lr LR] [--save ckpt.pt] [--metrics m.jsonl]
        [--timeout SECONDS] [--precision fp32|bf16|fp16|fp8] [--clip-grad-norm MAX]
        [--on-nonfinite stop|skip|continue] [--compile] [--compile-cache DIR]
        [--optimizer sgd|adamw] [--weight-decay WD] [--warmup N] [--checkpoint-dir D --save-every N]
        [--resume D] [--save-safetensors PATH] [--activation-checkpointing none|full|selective]
        [--load CKPT | --init model|per-module] [--cpu-bind auto|none]
        [--data TOKENS --seed S --data-order random|epoch] [--accept-data-change]
        [--eval-data TOKENS --eval-every N --eval-batches K] [--tensorboard DIR]
        [--log-every N] [--keep-last K] [--resume auto|D]

or, with this script as torchrun's launcher (a signal to it stops the ranks without a traceback)::

    python out/run.py --nproc-per-node R [torchrun options] -- [the options above]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .distributed import missing_dependency
from .failure import EXIT_FAILED, FailureChannel, PipelineError, agree, say, stall_message
from .loading import load_manifest
from . import checkpoint, cpu_binding, expert_parallel, host_memory, memory_fit, shm_p2p, tensor_parallel
from .memory import MeasuredPeak
from .mesh import coordinates, full, mesh_layout, world_size
from .optim import OPTIMIZERS, build_optimizer, build_scheduler, parameter_fqns, step_scheduler
from .pipeline import Pipeline, check_precision, step_ended
from .precision import PRECISIONS, describe as describe_precision, plain
from .job import Board, Progress, StopRequest, any_rank, check_tensorboard, clock
from .prefetch import BatchPrefetcher
from .run_options import fill_defaults
from . import weights
from .weights import INIT_MODES


# data.ORDERS, written here because runtime.data imports numpy, which must be importable before a rank can say it
# is missing (_check_dependencies runs after the arguments are parsed); tests/test_data.py holds them equal
DATA_ORDERS = ("random", "epoch")


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """run.py's options (docs/reference.md is generated from this parser)."""
    parser = argparse.ArgumentParser(
        prog="run.py", description="Train this pipeline: torchrun --nproc-per-node R out/run.py [options], or "
                                   "python out/run.py --nproc-per-node R [torchrun options] -- [options]")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate of the --optimizer (default 0.01)")
    parser.add_argument("--optimizer", default=None, choices=list(OPTIMIZERS),
                        help="optimizer when the model file has no optimizer(...) (default: what tracepp split "
                             "planned, else sgd)")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="weight decay of --optimizer on parameters with 2+ dims (not biases/norms)")
    parser.add_argument("--warmup", type=int, default=0, metavar="N",
                        help="linear LR warm-up over N steps, then cosine decay to 0 at --steps (default: constant)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="D",
                        help="write resumable checkpoints (torch.distributed.checkpoint) to D/step_N")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="with --checkpoint-dir: save after every N steps (always after the last step)")
    parser.add_argument("--resume", default=None, metavar="D|auto",
                        help="continue from the latest usable checkpoint in D up to --steps; a missing or empty D "
                             "starts from step 0 (one command for the first start and every restart); auto: D is "
                             "--checkpoint-dir")
    parser.add_argument("--keep-last", type=int, default=0, metavar="K",
                        help="with --checkpoint-dir: keep the K newest complete checkpoints, deleting older ones "
                             "once a newer one is complete (default: keep all)")
    parser.add_argument("--data", default=None, nargs="+", metavar="TOKENS",
                        help="train on windows of token files instead of the model file's batch(step): a file, a "
                             "folder, a glob, or a weighted mixture (0.7:web/*.bin,0.3:code/ or 0.7 web/ 0.3 "
                             "code/); nanoGPT's uint16 .bin, llm.c's headered .bin (uint16/uint32) or .npy, "
                             "memory-mapped")
    parser.add_argument("--data-order", default="random", choices=list(DATA_ORDERS),
                        help="with --data: random draws each step's windows with replacement (nanoGPT); epoch "
                             "reads every non-overlapping window once per pass, shuffled per pass from --seed "
                             "(a mixture: each source its own passes)")
    parser.add_argument("--seed", type=int, default=0,
                        help="with --data: the seed of the window order (each step's windows are a function of "
                             "it, the step and the data; default 0)")
    parser.add_argument("--accept-data-change", action="store_true",
                        help="with --resume and --data: continue although shards were added, removed or rewritten "
                             "since the checkpoint (named otherwise); every source starts a new pass at the resumed "
                             "step")
    parser.add_argument("--eval-data", default=None, nargs="+", metavar="TOKENS",
                        help="held-out token files (as --data): a forward-only pass over --eval-batches fixed "
                             "batches spread over them every --eval-every steps and at the end, printing and "
                             "logging val_loss")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="with --eval-data: evaluate every N steps (default: only at the end)")
    parser.add_argument("--eval-batches", type=int, default=8, metavar="K",
                        help="with --eval-data: batches per evaluation (default 8)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="write loss, val_loss, lr, grad norm, tokens/s and step time per step to DIR "
                             "(TensorBoard event files; needs the tensorboard package)")
    parser.add_argument("--log-every", type=int, default=1, metavar="N",
                        help="print a progress line every N steps (default 1); --metrics and --tensorboard "
                             "record every step")
    parser.add_argument("--save-safetensors", default=None, metavar="PATH",
                        help="write the trained weights as one safetensors file (tied weights once, HF layout)")
    parser.add_argument("--activation-checkpointing", default=None, metavar="MODE",
                        help="recompute stage forwards during backward: none, full (every stage), selective "
                             "(keep matmul, attention and collective outputs, recompute the rest), in-flight (full "
                             "for the stages holding several microbatches at once), or one of none/full/selective "
                             "per stage, comma-separated (default: what tracepp split planned, see run_options in "
                             "manifest.json)")
    parser.add_argument("--measure-memory", default=None, metavar="PATH",
                        help="measure each rank's peak tensor memory over the run's steps and write it beside the "
                             "plan's prediction to PATH (JSON), with a meter that shares no code with the plan's "
                             "count: on CPU torch's MemTracker (device totals; slower steps), on CUDA "
                             "max_memory_allocated")
    parser.add_argument("--memory-check", default="on", choices=list(memory_fit.MEMORY_CHECKS),
                        help="before the first step, compare the plan's peak per rank with the device's free "
                             "memory (CUDA) or the ranks of a host with its available RAM (CPU): on (default) stops "
                             "every rank when one cannot fit, naming the figures and the flags that would fit; warn "
                             "says so and runs; off skips it")
    parser.add_argument("--memory-reserve", default=None, metavar="SIZE[+PCT%]",
                        help=f"CUDA: what the fit check keeps free beside the plan's peak for NCCL's buffers and the "
                             f"caching allocator's fragmentation: a size (2GB), a share of the peak (10%%), or both "
                             f"(default {memory_fit.CUDA_RESERVE.replace('%', '%%')})")
    parser.add_argument("--save", default=None, help="write the trained state_dict (original FQNs) here")
    parser.add_argument("--metrics", default=None, help="append one JSON line per step here")
    parser.add_argument("--save-outputs", default=None, metavar="PATH",
                        help="forward-only model files (no loss_fn): write every step's model output here "
                             "(torch.save of a list, one full-batch output per step)")
    parser.add_argument("--load", default=None,
                        help="initial weights: a .safetensors or torch state_dict file, a Hugging Face folder, or a "
                             "torch.distributed.checkpoint folder, keyed by the model's FQNs; each rank reads its own")
    parser.add_argument("--init", default="model", choices=INIT_MODES,
                        help="without --load: 'model' builds model() and keeps this rank's tensors (equals eager); "
                             "'per-module' initialises only this rank's modules, seeded by FQN (large models)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any communication may wait before the job fails (default 120)")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    parser.add_argument("--precision", default=None, choices=list(PRECISIONS),
                        help="compute dtype (default: what tracepp split planned, see run_options in manifest.json): "
                             "fp32 master weights always; a folder split with --mixed-precision params (the "
                             "default) runs in the dtype its stage code was traced in (bf16 or fp8, fp16), one "
                             "split with fp32 or --mixed-precision autocast at fp32, or bf16/fp16 under autocast "
                             "(fp16: GPU only, with a dynamic loss scale; fp8: a GPU of compute capability 8.9+ "
                             "and torchao)")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                        help="clip the global L2 gradient norm (all stages, tied weights once) to MAX")
    parser.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip", "continue"],
                        help="a NaN/inf loss or gradient norm: stop the job (default), skip the optimizer step "
                             "on every rank, or apply it anyway")
    parser.add_argument("--cpu-bind", default="auto", choices=list(cpu_binding.MODES),
                        help="CPU ranks: auto (default) binds each local rank to its own share of the cores; "
                             "none leaves the affinity alone (e.g. numactl/taskset already bound the ranks)")
    parser.add_argument("--p2p", default="auto", choices=list(shm_p2p.MODES),
                        help="CPU ranks: auto (default) sends pipeline messages between ranks on one host through "
                             "shared-memory rings, gloo between hosts; shm: the same, an error where a pair "
                             "cannot; gloo: gloo only")
    parser.add_argument("--shm-ring-mb", type=float, default=shm_p2p.DEFAULT_RING_MB, metavar="MB",
                        help=f"size of each shared-memory ring in /dev/shm, one per directed pair of ranks that "
                             f"exchange messages (default {shm_p2p.DEFAULT_RING_MB}); a larger message streams "
                             f"through")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each stage (dynamic dims from the manifest marked dynamic)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="inductor cache folder for --compile (default OUT/compile_cache)")
    return parser


def launch(folder: str) -> None:
    """run.py's body: check the world size on every rank, then run this rank's script."""
    import runpy

    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        parse_args(["--help"])
    if "TORCHELASTIC_RUN_ID" not in os.environ and "RANK" not in os.environ and any(
            arg.split("=")[0] in ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--standalone")
            for arg in argv):
        from .job import launcher

        launcher(folder, argv)  # this process launches the ranks, each of which runs this file again
        return
    manifest = load_manifest(folder)
    rank = int(os.environ.get("RANK", "0"))
    try:
        check_world_size(manifest)
    except PipelineError as error:
        say(rank, f"error: {error}")
        sys.exit(EXIT_FAILED)
    problem = missing_dependency(int(os.environ.get("WORLD_SIZE", "1")))
    if problem is not None:  # every rank finds the same: one says it
        if rank == 0:
            say(rank, f"error: {problem}")
        sys.exit(EXIT_FAILED)
    _dp_index, pp_rank = coordinates(mesh_layout(manifest["plan"]), rank)  # replicas run their pipeline rank's script
    runpy.run_path(os.path.join(folder, f"rank{pp_rank}.py"), run_name="__main__")


def check_world_size(manifest: dict) -> None:
    layout = mesh_layout(manifest["plan"])
    expected = world_size(layout)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != expected:
        planned = (f"{expected} ranks" if expected == layout.pp else
                   f"{expected} processes ({layout.pp} pipeline ranks x {layout.dp} data-parallel replicas"
                   + (f" x {layout.cp} context-parallel ranks" if layout.cp > 1 else "")
                   + (f" x {layout.tp} tensor-parallel ranks)" if layout.tp > 1 else ")"))
        fix = (f"re-split with `tracepp split ... --ranks {world}`" if expected == layout.pp else
               f"re-split with --ranks R --dp N --cp C --tp T where R x N x C x T = {world}")
        raise PipelineError(
            f"this pipeline was planned for {planned} but torchrun started {world}: "
            f"run `{manifest['launch_command']}` in the pipeline's folder, or {fix}"
        )


def _gather_state_dict(manifest: dict, rank: int, state: dict, world: int, unused=None, include: bool = True,
                       user=None):
    """Every rank's state (``Pipeline.state_dict``) gathered on rank 0 and keyed by every original FQN (a tied
    weight's aliases name one tensor); None on the other ranks. ``include``: False on data-parallel replicas
    other than the first (same tensors). A model whose modules save another layout than they hold (manifest
    ``state_dict_hooks``) gets its own ``state_dict()``'s layout, through its hooks (``user``: the model file)."""
    mine = {name: tensor_parallel.whole(manifest, name, plain(full(tensor))).detach().cpu()  # full: a collective
            for name, tensor in state.items()}
    if not include:
        mine = {}
    parts = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(mine, parts, dst=0, group=_control_group())
    else:
        parts = [mine]
    if rank != 0:
        return None
    # state no stage reads never changes: rank 0 materialised it at start-up (runtime/weights.py)
    merged = {fqn: tensor.detach().cpu() for fqn, tensor in (unused or {}).items()}
    for part in parts:
        merged.update(part)
    aliases = {ref["fqn"]: ref["aliases"] for spec in manifest["stages"] for ref in spec["state"]}
    result = {}
    for fqn in manifest["state_dict_keys"]:
        canonical = next((c for c, names in aliases.items() if fqn in names and c in merged), fqn)
        result[fqn] = merged[canonical]
    if manifest.get("state_dict_hooks") and user is not None:
        result = weights.in_model_layout(user, result)
    return result


def _write_atomically(path: str, write) -> None:
    """``write(temporary)``, then rename: never leave a half-written file at ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = f"{path}.tmp{os.getpid()}"
    write(temporary)
    os.replace(temporary, path)


def _save(path: str, manifest: dict, rank: int, state: dict, world: int, unused=None, include: bool = True,
          user=None) -> None:
    """``--save``: one state_dict keyed by every original FQN (in the model's own layout), written by rank 0."""
    result = _gather_state_dict(manifest, rank, state, world, unused, include, user)
    if result is not None:
        _write_atomically(path, lambda temporary: torch.save(result, temporary))


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


def main(rank_script_rank: int, stage_functions: dict, actions: list, folder: str, shapes=None, argv=None,
         releases=None) -> None:
    args = parse_args(argv)
    manifest = load_manifest(folder)
    fill_defaults(args, manifest)  # the precision, checkpointing and optimizer the split planned for
    rank = int(os.environ.get("RANK", str(rank_script_rank)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # before the process group starts gloo's threads; the cores go into --metrics
    args.cpu_cores = cpu_binding.bind(args.cpu_bind) if _planned_device().type == "cpu" else None
    channel = FailureChannel(rank, world, args.timeout)
    channel.start_watchdog()
    args.stop = StopRequest().install()  # before the slow start-up: a signal during it stops after step 1
    try:
        check_world_size(manifest)
        _check_dependencies(world)
        check_tensorboard(args.tensorboard)
        try:
            check_precision(args.precision, _planned_device())
        except ValueError as error:  # the same on every rank: one says it
            failure = PipelineError(str(error))
            failure.every_rank_agrees = True
            raise failure from error
        pipe = Pipeline(folder, rank=rank, timeout_s=args.timeout, precision=args.precision,
                        activation_checkpointing=args.activation_checkpointing, memory_check="off",
                        compile=args.compile, compile_cache=args.compile_cache, stage_functions=stage_functions,
                        actions=actions, shapes=shapes, releases=releases,
                        check_finite=args.on_nonfinite != "continue", load=args.load, init=args.init,
                        p2p=args.p2p, shm_ring_mb=args.shm_ring_mb)
        train(pipe, args)
    except PipelineError as error:
        if getattr(error, "every_rank_agrees", False):  # each rank decided the same from the same data
            if rank == 0:
                print(f"[tracepp] error: {error}", file=sys.stderr, flush=True)
            _exit(EXIT_FAILED)
        channel.report(str(error), echo=not getattr(error, "printed_on_every_rank", False))
        _exit(EXIT_FAILED)
    except Exception as error:  # an unexpected failure: keep the traceback, and tell every rank
        cause = channel.peer_failure()
        if cause is not None:  # our error is the echo of a peer's crash (e.g. "connection closed by peer")
            say(rank, f"stopping because {cause}")
            _exit(EXIT_FAILED)
        traceback.print_exc()
        channel.report(f"{type(error).__name__}: {error}")
        _exit(EXIT_FAILED)
    if not channel.stop():  # the run's work is done; only the store, which is gone, did not answer
        _exit(0)


def _check_dependencies(world: int) -> None:
    problem = missing_dependency(world)
    if problem is not None:
        error = PipelineError(problem)
        error.every_rank_agrees = True  # the same Python on every rank: one says it
        raise error


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on peers that may be blocked: the watchdog tells them




def _planned_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DynamicLossScale:
    """fp16's loss scale, the same on every rank: halved (and the step skipped) when the gradient norm is not
    finite, doubled after ``growth_interval`` finite steps in a row (torch.amp.GradScaler's defaults)."""

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.scale = scale
        self.growth_interval = growth_interval
        self.finite_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale, self.finite_steps = self.scale / 2, 0
            return
        self.finite_steps += 1
        if self.finite_steps == self.growth_interval:
            self.scale, self.finite_steps = self.scale * 2, 0


def _banner(pipe: Pipeline, args) -> str:
    return describe_precision(pipe.precision, pipe.mixed_precision, pipe.fp8_recipe)


def user_batch(user, step: int, training: bool):
    """``batch(step)`` of the model file, or its example batch: (args tuple, kwargs, target)."""
    batch = user.batch(step) if hasattr(user, "batch") else (
        user.example_inputs(), user.example_kwargs() if hasattr(user, "example_kwargs") else {},
        user.example_target() if training else None)
    inputs, kwargs, target = batch if len(batch) == 3 else (*batch, None)
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return inputs, kwargs, target


def _update(pipe: Pipeline, args, step: int, loss, scaler, needs_norm: bool, optimizer, scheduler) -> tuple:
    """After a training step's backward: tied-weight sync, unscaling, the norm check and clipping, the optimizer
    and LR scheduler steps, zeroed gradients. ``loss``: the step's loss on the reporting rank, else None.
    Returns (gradient norm or None, whether the optimizer step was skipped, a note for the step's line, whether
    any rank was asked to stop: agreed on the norm's all-reduce, or by one of its own)."""
    norm, skipped, note = None, False, ""
    stop_here = args.stop.requested is not None
    try:
        pipe.sync_shared_grads()
    except RuntimeError as error:  # a peer stalled: name the collective, not gloo's recv
        if "timed out" not in str(error).lower():
            raise
        raise PipelineError(stall_message(
            pipe.rank, args.timeout, f"the tied-weight gradient sync (all-reduce) of step {step} with the "
            f"other ranks that hold a shared weight")) from error
    if scaler is not None:
        pipe.scale_grads(1.0 / scaler.scale)
    if needs_norm:
        loss_bad = loss is not None and not bool(torch.isfinite(loss))
        norm_t = pipe.grad_norm(nonfinite_loss=loss_bad, stop_requested=stop_here)
        stop = pipe.stop_agreed
        norm = float(norm_t)
        if not torch.isfinite(norm_t):
            skipped, note = _on_nonfinite(pipe, args, step, loss, scaler)
        elif args.clip_grad_norm is not None:
            pipe.clip_grad_norm_(args.clip_grad_norm, norm=norm_t)
        if scaler is not None:
            scaler.update(not skipped)
    else:
        stop = any_rank(stop_here, pipe.device)
    if optimizer is not None and not skipped:
        with getattr(args, "optimizer_context", contextlib.nullcontext)():
            optimizer.step()
    step_scheduler(scheduler, step)
    pipe.zero_grad(set_to_none=True)
    return norm, skipped, note, stop


def reports_for_job(pipe: Pipeline) -> bool:
    """Whether this rank prints and writes the job's lines: the last stage's, first replica (its loss is the global
    batch's), first tp and cp rank."""
    return pipe.is_last_rank and pipe.dp_index == 0 and pipe.tp_index == 0 and pipe.cp_index == 0


def _minor_faults():
    """This process's minor page faults so far (None where ``resource`` is missing): a step that faults in
    thousands of pages spends milliseconds in the kernel (about 3.7 us each on the project's VM)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _report_step(pipe: Pipeline, args, step: int, result, elapsed: float, cpu_time: float, norm, skipped: bool,
                 note: str, faults, job, experts=None) -> tuple:
    """The reporting rank's line, ``--metrics`` record and TensorBoard scalars of one step; returns its (step,
    loss, seconds, samples/s, expert load). ``job``: the loop's JobState (tokens per step, progress, board,
    learning rate); ``experts``: ``Pipeline.expert_load()``."""
    training, device = pipe.training, pipe.device
    loss_value = float(result) if training and result is not None and not isinstance(result, list) else None
    samples = pipe.last_batch_size
    tokens = samples * job.seq if job.seq else None
    job.progress.record(elapsed)
    lr = job.lr()
    if not args.quiet and ((step + 1) % max(args.log_every, 1) == 0 or step + 1 == args.steps or step == 0):
        text = f"loss {loss_value:.6f} | " if loss_value is not None else ""
        text += f"grad norm {norm:.4f} | " if norm is not None else ""
        if experts is not None:
            text += f"experts max/mean {experts['imbalance']:.2f}" + (
                f" dropped {experts['dropped']} | " if experts["dropped"] else " | ")
        rate = f"{tokens / elapsed:,.0f} tok/s" if tokens else f"{samples / elapsed:.1f} samples/s"
        print(f"step {step + 1}/{args.steps} | {text}{elapsed * 1000:.1f} ms | {rate} | "
              f"elapsed {clock(job.progress.elapsed())} | eta {clock(job.progress.eta(step + 1))}{note}", flush=True)
    record = {"step": step, "loss": loss_value, "step_time_s": elapsed, "cpu_time_s": cpu_time,
              "samples_per_s": samples / elapsed, "batch_size": samples}
    if tokens:
        record["tokens_per_s"] = tokens / elapsed
    if lr is not None:
        record["lr"] = lr
    if norm is not None:
        record["grad_norm"] = norm
    if experts is not None:  # the worst-balanced block of routed experts, over the global batch
        record.update({"moe_tokens_per_expert_max": experts["max"], "moe_tokens_per_expert_mean": experts["mean"],
                       "moe_imbalance": experts["imbalance"], "moe_dropped": experts["dropped"]})
    if job.source is not None:
        record.update(job.source.position(step))
    if job.board is not None:
        job.board.scalars(step + 1, {"train/loss": loss_value, "train/lr": lr, "train/grad_norm": norm,
                                     "train/tokens_per_s": record.get("tokens_per_s"), "train/step_time_s": elapsed,
                                     "moe/imbalance": record.get("moe_imbalance"),
                                     "moe/tokens_per_expert_max": record.get("moe_tokens_per_expert_max"),
                                     "moe/dropped": record.get("moe_dropped"),
                                     **(job.source.scalars(step) if job.source is not None else {})})
    if args.metrics:
        if faults is not None:
            record["minor_faults"] = faults
        if device.type == "cuda":
            record["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        if skipped:
            record["skipped"] = True
        if args.cpu_cores:
            record["cpu_cores"] = args.cpu_cores
        if pipe.world_size > 1:
            record["p2p"] = pipe.p2p_transport()
        _append_metrics(args.metrics, record)
    return step, loss_value, elapsed, samples / elapsed, experts


def _append_metrics(path: str, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


class JobState:
    """What the loop keeps for a long job's reporting: progress, the TensorBoard writer, tokens per sample."""

    def __init__(self, pipe: Pipeline, args, first_step: int, optimizer, reports: bool, source=None):
        record = pipe.manifest.get("token_input")
        self.source = source  # --data: tokens seen and passes go into the metrics and TensorBoard
        self.seq = record["seq"] if record else None
        self.progress = Progress(args.steps)
        self.optimizer = optimizer
        self.board = Board(args.tensorboard, purge_step=first_step + 1) if reports and args.tensorboard else None

    def lr(self):
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None


def _check_job_flags(pipe: Pipeline, args) -> None:
    """The long-job flags make sense together, else an error naming the flag and the fix."""
    if args.resume == "auto":
        if not args.checkpoint_dir:
            raise PipelineError("--resume auto resumes from --checkpoint-dir: pass --checkpoint-dir D (the folder "
                                "this run saves to), or --resume D")
        args.resume = args.checkpoint_dir
    if args.keep_last < 0 or (args.keep_last and not args.checkpoint_dir):
        raise PipelineError(f"--keep-last {args.keep_last} keeps the newest K >= 1 checkpoints of --checkpoint-dir: "
                            f"pass --checkpoint-dir D and a positive K")
    if (args.eval_every or args.eval_batches != 8) and not args.eval_data:
        raise PipelineError("--eval-every/--eval-batches evaluate on --eval-data: pass --eval-data TOKENS (a "
                            "held-out token file)")
    if args.eval_data and not (pipe.training and hasattr(pipe.user, "loss_fn")):
        raise PipelineError(f"--eval-data {' '.join(args.eval_data)} reports a validation loss, and this model "
                            f"file has no loss_fn: drop --eval-data")
    if (args.data_order != "random" or args.accept_data_change) and not args.data:
        raise PipelineError("--data-order/--accept-data-change are about the token files of --data: pass --data "
                            "TOKENS, or drop them")
    if args.eval_every < 0 or args.eval_batches < 1 or args.log_every < 1:
        raise PipelineError(f"--eval-every {args.eval_every}, --eval-batches {args.eval_batches}, --log-every "
                            f"{args.log_every}: use --eval-every >= 0 and the others >= 1")


def evaluate(pipe: Pipeline, batches) -> float:
    """The mean loss over ``batches`` (``len`` and ``batches[index]``: ``(args, kwargs, target)``) through the
    pipeline, forward only; on the last stage's rank (None elsewhere). Every rank calls it with the same batches."""
    loader = BatchPrefetcher(lambda index: batches[index], pipe.device)  # on the device, as training batches
    total = 0.0
    for index in range(len(batches)):
        loss = pipe.eval_step(*loader.get(index))
        if loss is not None:
            total += float(loss)
    expert_parallel.take_stats()  # evaluation's routing is not the training step's expert load
    return total / len(batches) if pipe.is_last_rank else None


def _run_eval(pipe: Pipeline, args, evals, step: int, reports: bool, job: JobState) -> None:
    start = time.perf_counter()
    value = evaluate(pipe, evals)
    if not reports:
        return
    if not args.quiet:
        print(f"eval after step {step} | val_loss {value:.6f} | {evals.count} batches | "
              f"{(time.perf_counter() - start) * 1000:.0f} ms", flush=True)
    if args.metrics:
        _append_metrics(args.metrics, {"step": step - 1, "val_loss": value})
    if job.board is not None:
        job.board.scalars(step, {"val/loss": value})


def train(pipe: Pipeline, args) -> None:
    """The loop of run.py around ``Pipeline.step``: data, precision, norm check and clipping, optimizer, metrics,
    validation, checkpoints (periodic, on a requested stop, pruned), save."""
    manifest, user, device = pipe.manifest, pipe.user, pipe.device
    training = pipe.training
    rank, world = pipe.rank, pipe.world_size
    if args.save_every and not args.checkpoint_dir:
        raise PipelineError(f"--save-every {args.save_every} needs --checkpoint-dir D (the folder for D/step_N)")
    if args.save_outputs and training:
        raise PipelineError(f"--save-outputs {args.save_outputs} is for forward-only model files (without "
                            f"loss_fn); this one trains: drop the flag, or use Pipeline.eval_step in your own loop")
    _check_job_flags(pipe, args)
    if not hasattr(args, "stop"):  # a caller of train() other than main(): no signal handling
        args.stop = StopRequest()
    from .data import EvalBatches, TokenBatches, data_record

    source = TokenBatches(args.data, manifest, args.seed, args.data_order) if args.data else None
    evals = EvalBatches(args.eval_data, manifest, args.eval_batches) if args.eval_data else None
    named = [(name, p) for name, p in pipe.named_parameters() if p.requires_grad]
    optimizer, scheduler, fqns = None, None, []
    if training and named:
        optimizer = build_optimizer(user, named, name=args.optimizer, lr=args.lr, weight_decay=args.weight_decay)
        fqns = parameter_fqns(optimizer, named)
        scheduler = build_scheduler(user, optimizer, warmup=args.warmup, total_steps=args.steps)
    # the precision and checkpointing are the Pipeline's (the split's unless run.py's flags say otherwise); the fit
    # check runs here, once the optimizer run.py builds is known
    pipe.check_memory(getattr(args, "memory_check", "on"), getattr(args, "memory_reserve", None), args.optimizer)
    reports = reports_for_job(pipe)
    args.data_record = data_record(source)
    first_step = _resume(pipe, args, optimizer, scheduler, fqns) if args.resume else 0
    if source is not None:
        source.follow(args.data_record)  # a resume's record: an accepted data change restarts the passes
    scaler = DynamicLossScale() if pipe.precision == "fp16" else None
    needs_norm = training and (args.clip_grad_norm is not None or args.on_nonfinite != "continue"
                               or scaler is not None)
    if reports and not args.quiet:
        print(_banner(pipe, args), flush=True)
        if source is not None:
            also = "; the model file's batch(step) is not used (--data wins)" if hasattr(user, "batch") else ""
            print(source.describe() + also, flush=True)
    job = JobState(pipe, args, first_step, optimizer, reports, source)
    history, outputs = [], []
    host_memory.configure(device)  # CPU ranks: freed tensors go back to the OS (see host_memory.py)
    batches = BatchPrefetcher(source or (lambda index: user_batch(user, index, training)), device)
    stopped = None
    measure = None
    if getattr(args, "measure_memory", None):
        measure = MeasuredPeak(pipe)
        measure.start()
    args.optimizer_context = measure.optimizer if measure is not None else contextlib.nullcontext
    for step in range(first_step, args.steps):
        # on GPUs pinned and copied on a side stream; the step waits for the copy, so what of it is not done
        # by then is counted in the step time below
        inputs, kwargs, target = batches.get(step)
        start, cpu_start, faults_start = time.perf_counter(), time.process_time(), _minor_faults()
        pipe.loss_scale = scaler.scale if scaler is not None else None
        result = pipe.step(inputs, kwargs, target)
        host_memory.release(device)  # before the optimizer allocates its state or updates anything
        norm, skipped, note = None, False, ""
        if training:
            norm, skipped, note, stop = _update(pipe, args, step, result if reports else None, scaler, needs_norm,
                                                optimizer, scheduler)
        else:
            stop = any_rank(args.stop.requested is not None, device)
        experts = pipe.expert_load()  # tokens per routed expert (a collective; None without routed experts)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        cpu_time = time.process_time() - cpu_start  # this rank's CPU time: a measure that load does not stretch
        faults = None if faults_start is None else _minor_faults() - faults_start
        if args.save_outputs:
            outputs.append(_replica_outputs(pipe, result))
        if reports:
            history.append(_report_step(pipe, args, step, result, elapsed, cpu_time, norm, skipped, note, faults,
                                        job, experts))
        step_ended(pipe, step)
        done = step + 1
        if evals is not None and args.eval_every and done % args.eval_every == 0 and done != args.steps and not stop:
            _run_eval(pipe, args, evals, done, reports, job)
        periodic = args.save_every > 0 and done % args.save_every == 0
        if args.checkpoint_dir and (periodic or done == args.steps or stop):
            _save_checkpoint(pipe, args, done, optimizer, fqns, reports)
        if stop:
            stopped = done
            break
    if measure is not None:
        memory_fit.report(pipe, args, measure.stop())
    if stopped is not None:
        _stopped(pipe, args, stopped, reports)
    else:
        if evals is not None:
            _run_eval(pipe, args, evals, args.steps, reports, job)
        if args.save_outputs and reports:
            _write_atomically(args.save_outputs, lambda temporary: torch.save(outputs, temporary))
        if args.save_safetensors:
            _save_safetensors(args.save_safetensors, manifest, rank, pipe.state_dict(), world, pipe.unused_state,
                              include=pipe.dp_index == 0 and pipe.cp_index == 0, user=pipe.user)
        if args.save:
            _save(args.save, manifest, rank, pipe.state_dict(), world, pipe.unused_state,
                  include=pipe.dp_index == 0 and pipe.cp_index == 0, user=pipe.user)
    if job.board is not None:
        job.board.close()
    if world > 1:
        dist.barrier(group=_control_group())
    if reports and history and not args.quiet and stopped is None:
        _summary(pipe, args, history)
    if dist.is_initialized():  # torchrun with one rank starts a group too (NCCL warns at exit if it is left)
        dist.destroy_process_group()


def _checkpoint_view(pipe: Pipeline, for_save: bool):
    """What DCP sees of each tensor: tensor-parallel fused projections in the model's own layout."""
    return tensor_parallel.checkpoint_view(pipe.manifest, for_save) if pipe.tp_mesh is not None else None


def _save_checkpoint(pipe: Pipeline, args, step: int, optimizer, fqns: list, reports: bool) -> None:
    path = checkpoint.save(args.checkpoint_dir, step, pipe.state_dict(), optimizer, fqns,
                           _checkpoint_info(pipe, optimizer, args), pipe.rank, group=_control_group_or_none(pipe),
                           keep_last=args.keep_last, view=_checkpoint_view(pipe, for_save=True))
    if reports and not args.quiet:
        print(f"checkpoint {path}", flush=True)


def _control_group_or_none(pipe: Pipeline):
    return _control_group() if pipe.world_size > 1 else None


def _stopped(pipe: Pipeline, args, step: int, reports: bool) -> None:
    """A requested stop (a signal) after ``step``: say where the work is and how to go on."""
    if not reports:
        return
    why = args.stop.requested or "a signal to another rank"
    if args.checkpoint_dir:
        where = os.path.join(args.checkpoint_dir, f"step_{step}")
        print(f"stopped by {why} after step {step}/{args.steps}: saved {where}; to continue, run the same command "
              f"with --resume auto (or --resume {args.checkpoint_dir})", flush=True)
    else:
        print(f"stopped by {why} after step {step}/{args.steps}; nothing was saved (no --checkpoint-dir): pass "
              f"--checkpoint-dir D --resume auto to make a stopped job resumable", flush=True)


def join_microbatches(outputs: list, dim: int = 0):
    """Per-microbatch outputs of one step -> the full batch's output, structure kept: tensor leaves with a batch
    dim are concatenated along it (``dim``: the model file's ``batch_dim``); a leaf equal in every microbatch (a
    constant) is kept once; any other leaf (a per-microbatch scalar) becomes the list of its microbatch values."""
    import torch.utils._pytree as pytree

    flat = [pytree.tree_flatten(output) for output in outputs]
    spec = flat[0][1]
    joined = []
    for leaves in zip(*(leaves for leaves, _spec in flat)):
        if all(isinstance(leaf, torch.Tensor) and leaf.dim() > dim for leaf in leaves):
            joined.append(torch.cat([leaf.detach().cpu() for leaf in leaves], dim=dim))
        elif all(not isinstance(leaf, torch.Tensor) and leaf == leaves[0] for leaf in leaves):
            joined.append(leaves[0])
        else:
            joined.append([leaf.detach().cpu() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
    return pytree.tree_unflatten(joined, spec)


def _replica_outputs(pipe: Pipeline, result):
    """``--save-outputs``: this step's full-batch output on the last pipeline rank of the first replica (the
    other replicas' slices gathered to it in replica order), None elsewhere."""
    if pipe.layout.dp > 1 and pipe.is_last_rank:
        parts = [None] * pipe.layout.dp
        dist.all_gather_object(parts, result, group=pipe.replicas.get_group())
        result = [output for part in parts for output in part]
    return join_microbatches(result, pipe.splitter.batch_dim) if reports_for_job(pipe) else None


def _checkpoint_info(pipe: Pipeline, optimizer, args=None) -> dict:
    manifest = pipe.manifest
    info = {"model_sha256": manifest["model_sha256"], "fqns": sorted(manifest["state_dict_keys"]),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "world_size": pipe.world_size, "stage_to_rank": manifest["plan"]["stage_to_rank"]}
    if args is not None:
        info["data"] = args.data_record  # with the step: where the data stream continues
    return info


def _resume(pipe: Pipeline, args, optimizer, scheduler, fqns: list) -> int:
    """Load the newest usable checkpoint of ``--resume``; returns the step to continue from (0: there is none
    yet, a first start). Every rank verifies its share of the files, then checks the checkpoint against its own
    stages, and the ranks agree (one small gather) before anything is loaded: a bad checkpoint stops every rank
    with the message, before anything is trained or written."""
    group = _control_group_or_none(pipe)
    try:
        found = checkpoint.usable(args.resume, pipe.rank, pipe.world_size, group,
                                  report=lambda text: say(pipe.rank, text))
    except checkpoint.CheckpointError as error:
        error.every_rank_agrees = True
        raise
    if found is None:
        if reports_for_job(pipe) and not args.quiet:
            print(f"--resume {args.resume}: no checkpoint yet; starting from step 0", flush=True)
        return 0
    try:
        step, path, prepared = _check_resume(pipe, args, optimizer, scheduler, fqns, *found)
        problem = None
    except PipelineError as error:
        step, path, prepared, problem = None, None, None, str(error)
    agree(problem, group=group)
    checkpoint.load(prepared, optimizer, fqns)
    from .data import accepted_note

    if reports_for_job(pipe) and not args.quiet:
        print(f"resumed from {path} (step {step}); training steps {step + 1} to {args.steps}", flush=True)
        if accepted_note(args.data_record, step):
            print(accepted_note(args.data_record, step), flush=True)
    return step


def _check_resume(pipe: Pipeline, args, optimizer, scheduler, fqns: list, step: int, path: str) -> tuple:
    from .data import check_resumed

    info = checkpoint.read_info(path)
    checkpoint.check_compatible(path, info, _checkpoint_info(pipe, optimizer))
    args.data_record = check_resumed(path, info.get("data"), args.data_record, step, args.accept_data_change)
    if scheduler is not None:  # a schedule is a function of the step count: step a fresh one to `step`
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for done in range(step):
                step_scheduler(scheduler, done)
    if optimizer is not None:
        group_of = [group for group in optimizer.param_groups for _param in group["params"]]
        for fqn, group in zip(fqns, group_of):
            saved = info["param_groups"].get(fqn, {}).get("lr")
            if saved is not None and abs(saved - group["lr"]) > 1e-12 * max(1.0, abs(saved)):
                raise PipelineError(
                    f"checkpoint {path}: the learning rate of {fqn} was {saved} at step {step} but this run's "
                    f"LR schedule gives {group['lr']}: use the same --lr/--warmup/--steps or lr_scheduler(...) "
                    f"as the run that wrote it")
    prepared = checkpoint.prepare_load(path, pipe.state_dict(), optimizer, fqns, pipe.rank,
                                       info["world_size"] == pipe.world_size, view=_checkpoint_view(pipe, False))
    return step, path, prepared


def _save_safetensors(path: str, manifest: dict, rank: int, state: dict, world: int, unused=None,
                      include: bool = True, user=None) -> None:
    """Like ``--save`` but one safetensors file; a tied weight is written once, under its first FQN in the
    model's state_dict order (``model.embed_tokens.weight``, not ``lm_head.weight``), as Hugging Face does."""
    if rank == 0:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as error:
            raise PipelineError("--save-safetensors needs the safetensors package: pip install safetensors") from error
    full_state = _gather_state_dict(manifest, rank, state, world, unused, include, user)
    if full_state is None:
        return
    import safetensors.torch

    tensors, seen = {}, set()
    for fqn, tensor in full_state.items():
        key = tensor.untyped_storage().data_ptr()
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        tensors[fqn] = tensor.contiguous()
    _write_atomically(path, lambda temporary: safetensors.torch.save_file(tensors, temporary,
                                                                           metadata={"format": "pt"}))


def _on_nonfinite(pipe: Pipeline, args, step: int, loss, scaler) -> tuple:
    """A NaN/inf loss or gradient norm, seen on every rank at once: (skip the step?, note for the step line).
    ``stop`` raises on every rank (the job exits non-zero before --save); fp16 overflow skips the step."""
    where = pipe.nonfinite_report(loss=None if loss is None else float(loss))
    text = f"step {step + 1}: non-finite loss or gradient norm; {where}"
    if scaler is not None and args.on_nonfinite != "continue":
        return True, f" | skipped (fp16 overflow, loss scale {scaler.scale:g} -> {scaler.scale / 2:g}; {where})"
    if args.on_nonfinite == "stop":
        error = PipelineError(f"{text}. Nothing was saved. Look for the NaN/inf there (inputs, weights, a "
                              f"learning rate too high), or pass --on-nonfinite skip|continue")
        say(pipe.rank, f"error: {error}")
        if pipe.world_size > 1:  # every rank saw it: let each print before any exits (torchrun kills the rest)
            dist.barrier(group=_control_group())
        error.printed_on_every_rank = True
        raise error
    if args.on_nonfinite == "skip":
        say(pipe.rank, f"{text}: optimizer step skipped on every rank")
        return True, " | skipped (non-finite)"
    return False, " | non-finite"


def _expert_rows(loads: list) -> list:
    """The summary's routed-expert rows: the median and worst max/mean tokens per expert, pairs dropped."""
    if not loads:
        return []
    ratios = sorted(load["imbalance"] for load in loads)
    return [["experts max/mean tokens", f"{ratios[len(ratios) // 2]:.2f} median, {ratios[-1]:.2f} worst"],
            ["(token, expert) pairs dropped", str(sum(load["dropped"] for load in loads))]]


def _summary(pipe: Pipeline, args, history: list) -> None:
    manifest = pipe.manifest
    training = pipe.training
    times = sorted(h[2] for h in history)
    rows = [["steps", len(history)], ["first loss", f"{history[0][1]:.6f}" if training else "-"],
            ["last loss", f"{history[-1][1]:.6f}" if training else "-"],
            ["median step time (ms)", f"{times[len(times) // 2] * 1000:.1f}"],
            ["samples/s (median)", f"{sorted(h[3] for h in history)[len(history) // 2]:.1f}"],
            *_expert_rows([h[4] for h in history if h[4] is not None]),
            ["ranks / stages", f"{pipe.world_size} / {len(manifest['stages'])}"],
            *([["data parallel", f"{pipe.layout.dp} replicas x {pipe.layout.pp} pipeline ranks, "
                                 f"{pipe.layout.dp_mode}"]] if pipe.layout.dp > 1 else []),
            ["schedule", manifest["plan"]["schedule"]], ["microbatches", manifest["plan"]["num_microbatches"]],
            ["precision", pipe.precision], ["backend", pipe.backend]]
    print(_format_table(rows, ["summary", "value"]), flush=True)
    if args.save:
        print(f"saved {args.save}", flush=True)
