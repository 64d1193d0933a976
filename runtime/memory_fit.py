"""Does the job fit? The plan's peak per rank (``manifest["memory"]``, counted at split time) against the device
before the first step, and against what the run measured after the last (``run.py --measure-memory``).

* CUDA: a rank whose predicted peak and the reserve (``--memory-reserve``, default :data:`CUDA_RESERVE`: NCCL's
  buffers and the caching allocator's fragmentation) are more than its device can give (free memory plus what this
  process already holds: its weights are loaded by then) stops every rank before step 1, naming the figures, the
  parts of the peak and the split options that would fit (``manifest["memory"]["alternatives"]``: the same plan
  under other activation checkpointing), and the other ways out (more microbatches, tp, ep, more ranks).
* CPU: the ranks on one host share its RAM: their predicted peaks and shared-memory rings summed are compared with
  the RAM available, and every rank stops when they exceed it (``--memory-check warn``: a warning instead).

The figure is the plan's only for the options it was planned with (precision, activation checkpointing,
optimizer): a run that changes them is told so (once) instead of compared. A rank whose figure is a bound (a stage
its split could not count) says so. ``Pipeline(folder)`` runs the check for a loop of your own.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from .failure import PipelineError, say
from .run_options import manifest_options

GB = 1e9


def size_text(value: float) -> str:
    """Bytes in the unit that reads best (GB, MB or KB, decimal)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def planned_peaks(manifest: dict):
    """[peak bytes per pipeline rank] of the plan, or None for a folder split before memory was counted."""
    ranks = (manifest.get("memory") or {}).get("ranks")
    return [r["peak_bytes"] for r in ranks] if ranks else None


# What a CUDA rank holds beyond the tensors the plan counts, kept free by the fit check: NCCL's communicator buffers
# (made at each group's first collective, most after the check runs: the pipeline's peer pairs, dp, tp) and the
# caching allocator's reserve above what it hands out (fragmentation), a share of the peak. The CUDA context itself
# is already out of the free memory the check reads. TO BE MEASURED on a GPU (benchmarks/cuda_reserve.py): until
# then a conservative figure, above what torch 2.x's NCCL communicators (about 0.1 - 0.5 GB each with default
# buffers) and the allocator's fragmentation on training steps (5 - 10 % of the peak) are reported to hold.
CUDA_RESERVE = "2GB+11%"  # measured: benchmarks/results/20261128-192900_cuda_reserve.json
MEMORY_CHECKS = ("on", "warn", "off")


def parse_reserve(text) -> tuple:
    """``--memory-reserve``: ``"2GB"`` (bytes kept free), ``"10%"`` (of the rank's peak) or ``"2GB+10%"``; None:
    :data:`CUDA_RESERVE`. Returns (bytes, fraction of the peak)."""
    text = CUDA_RESERVE if text is None else str(text)
    fixed, fraction = 0, 0.0
    for part in text.replace(" ", "").split("+"):
        try:
            if part.endswith("%"):
                fraction += float(part[:-1]) / 100
            else:
                fixed += parse_size(part)
        except ValueError:
            raise PipelineError(f"--memory-reserve {text!r}: give a size (2GB, 512MB), a share of the peak (10%), "
                                f"or both (2GB+10%)") from None
    return fixed, fraction


def parse_size(text: str) -> int:
    """``80GB``, ``512MB``, ``1.5GiB``, ``1024`` (bytes) -> bytes."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}
    text = text.strip().upper()
    number = text.rstrip("KMGTIB")
    unit = text[len(number):]
    if unit not in units or not number:
        raise ValueError(text)
    return int(float(number) * units[unit])


def reserve_bytes(reserve, peak: int) -> int:
    fixed, fraction = parse_reserve(reserve)
    return int(fixed + fraction * peak)


def mismatch(manifest: dict, args) -> list:
    """The run options of this run (run.py's ``args``) that differ from those the plan counted memory for."""
    from .run_options import chosen

    optimizer = None if hasattr(getattr(args, "user_module", None), "optimizer") else args.optimizer
    return chosen(manifest, precision=args.precision, activation_checkpointing=args.activation_checkpointing,
                  optimizer=optimizer)[1]


def _parts_text(parts: dict) -> str:
    return ", ".join(f"{name} {size_text(value)}" for name, value in parts.items() if value)


def _ways_out(manifest: dict, rank: int, room: float) -> str:
    """The recorded alternatives that fit ``room`` bytes on this rank, and the general ones."""
    options = []
    for mode, peaks in ((manifest.get("memory") or {}).get("alternatives") or {}).items():
        if rank < len(peaks) and peaks[rank] <= room:
            options.append(f"`--activation-checkpointing {mode}` ({size_text(peaks[rank])})")
    text = ("re-split with " + " or ".join(options) + "; or " if options else "re-split with ")
    return text + ("more --microbatches (fewer samples in flight), a larger --tp or --ep, or more --ranks; "
                   "`tracepp plan OUT --tune --memory-limit SIZE` searches them")


def check(pipe, mode: str = "on", reserve=None, differs=(), unnamed=()) -> None:
    """Before the first step (see the module doc): ``Pipeline.check_memory``. ``mode``: ``on`` stops every rank when
    one does not fit; ``warn`` says so and goes on. ``differs``: the run options that are not the plan's (the check
    is then skipped: its figures are for others); ``unnamed``: those of them not named yet, named here once."""
    peaks = planned_peaks(pipe.manifest)
    if peaks is None or not pipe.training or mode == "off":
        return
    if differs:
        if unnamed and pipe.rank == 0:
            say(pipe.rank, "note: the plan's memory figures are for other run options than "
                           f"{'; '.join(unnamed)}: split again with them to check that the job fits")
        return
    entry = pipe.manifest["memory"]["ranks"][pipe.pp_rank]
    predicted = entry["peak_bytes"]
    bound = " (a bound: a stage's memory could not be counted)" if entry.get("bound") else ""
    if pipe.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(pipe.device)
        held = torch.cuda.memory_allocated(pipe.device)
        room = free + held
        kept = reserve_bytes(reserve, predicted)
        problem = None
        if predicted + kept > room:
            problem = (f"rank {pipe.rank} (pipeline rank {pipe.pp_rank}) needs {size_text(predicted)} at its "
                       f"peak{bound} "
                       f"({entry.get('at', '')}: {_parts_text(entry.get('parts') or {})}) and {size_text(kept)} kept "
                       f"for NCCL's buffers and the allocator's fragmentation (--memory-reserve "
                       f"{reserve or CUDA_RESERVE}) but {pipe.device} can give {size_text(room)} ({size_text(free)} "
                       f"free of {size_text(total)}, plus {size_text(held)} this rank holds): "
                       + _ways_out(pipe.manifest, pipe.pp_rank, room - kept))
        _agree(pipe, problem, mode)
        return
    problem = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        problem = _host_problem(pipe, peaks, bound)
    _agree(pipe, problem, mode)


def _host_problem(pipe, peaks: list, bound: str):
    """CPU: the ranks of this host (torchrun's local ranks: consecutive global ranks) hold their planned peaks and
    their shared-memory rings in its RAM; a problem naming the figures when the RAM available is less."""
    from .mesh import coordinates

    available = available_ram()
    if available is None:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = pipe.rank - int(os.environ.get("LOCAL_RANK", "0"))
    ranks = (pipe.manifest.get("memory") or {}).get("ranks") or []
    pp_ranks = [coordinates(pipe.layout, r)[1] for r in range(first, min(first + local, max(pipe.world_size, 1)))]
    need = sum(peaks[p] + (ranks[p].get("rings_bytes") or 0) for p in pp_ranks)
    if need <= available:
        return None
    return (f"the {len(pp_ranks)} ranks on this host need {size_text(need)} at their peaks{bound} (the plan's figures "
            f"and their shared-memory rings; the largest, pipeline rank {max(pp_ranks, key=peaks.__getitem__)}, "
            f"{size_text(max(peaks[p] for p in pp_ranks))}) and {size_text(available)} of RAM is available: the job "
            f"would swap or be killed. Pass --memory-check warn to run anyway, or "
            + _ways_out(pipe.manifest, pipe.pp_rank, available / max(len(pp_ranks), 1)))


def _agree(pipe, problem, mode: str = "on") -> None:
    """Every rank stops if one does not fit (each says its own figures); with ``warn`` the ranks that found a problem
    say it and every rank goes on."""
    if mode == "warn":
        if problem:
            say(pipe.rank, f"warning: {problem}")
        return
    anywhere = bool(problem)
    if pipe.world_size > 1:
        flag = torch.tensor([1.0 if problem else 0.0], device=pipe.device)
        dist.all_reduce(flag)
        anywhere = float(flag) > 0
    if problem:
        raise PipelineError(problem)
    if anywhere:
        error = PipelineError("another rank's predicted peak does not fit its device (it names the figures)")
        error.every_rank_agrees = False
        raise error


def available_ram():
    """Free host memory (Linux's MemAvailable) in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def report(pipe, args, measured: dict) -> None:
    """After the last step: every rank's measured peak beside the plan's, written to ``--measure-memory`` PATH by
    rank 0 and printed there, one line per rank."""
    record = {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "dp_index": pipe.dp_index, "tp_index": pipe.tp_index,
              "measured": measured}
    gathered = [record]
    if pipe.world_size > 1:
        gathered = [None] * pipe.world_size
        dist.all_gather_object(gathered, record)
    if pipe.rank != 0:
        return
    planned = (pipe.manifest.get("memory") or {}).get("ranks") or []
    args.user_module = pipe.user
    different = mismatch(pipe.manifest, args)
    for item in gathered:
        entry = planned[item["pp_rank"]] if item["pp_rank"] < len(planned) else None
        item["predicted"] = None if entry is None or different else {
            "peak_bytes": entry["peak_bytes"], "parts": entry.get("parts"), "at": entry.get("at"),
            "bound": bool(entry.get("bound"))}
        if item["predicted"]:
            item["ratio"] = item["measured"]["peak_bytes"] / item["predicted"]["peak_bytes"]
    out = {"steps": args.steps, "run_options": {"precision": args.precision,
                                                "activation_checkpointing": args.activation_checkpointing,
                                                "optimizer": args.optimizer},
           "planned_for": pipe.manifest.get("run_options"), "differs": different, "ranks": gathered}
    with open(args.measure_memory, "w") as handle:
        json.dump(out, handle, indent=1)
    for item in gathered:
        predicted = item["predicted"]
        text = (f"predicted {size_text(predicted['peak_bytes'])}, ratio {item['ratio']:.3f}" if predicted else
                "no prediction for these options")
        print(f"memory: rank {item['rank']} (pipeline rank {item['pp_rank']}): measured peak "
              f"{size_text(item['measured']['peak_bytes'])}; {text}", flush=True)
