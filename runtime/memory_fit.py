"""Does the job fit? The plan's peak per rank (``manifest["memory"]``, counted at split time) against the device
before the first step, and against what the run measured after the last (``run.py --measure-memory``).

* CUDA: a rank whose predicted peak is more than its device can give (free memory plus what this process already
  holds: its weights are loaded by then) stops every rank before step 1, naming the figures, the parts of the peak
  and the split options that would fit (``manifest["memory"]["alternatives"]``: the same plan under other
  activation checkpointing), and the other ways out (more microbatches, tp, ep, more ranks).
* CPU: the ranks on one host share its RAM: their predicted peaks summed are compared with the RAM available, and
  local rank 0 warns when they exceed it.

The figure is the plan's only for the options it was planned with (precision, activation checkpointing,
optimizer): run.py flags that change them make the check say so instead of comparing.
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


def mismatch(manifest: dict, args) -> list:
    """The run options of this run that differ from those the plan counted memory for."""
    planned = manifest_options(manifest)
    found = []
    if args.precision != planned.precision:
        found.append(f"--precision {args.precision} (planned {planned.precision})")
    if args.activation_checkpointing != planned.activation_checkpointing:
        found.append(f"--activation-checkpointing {args.activation_checkpointing} "
                     f"(planned {planned.activation_checkpointing})")
    if not hasattr(getattr(args, "user_module", None), "optimizer") and args.optimizer != (planned.optimizer or "sgd"):
        found.append(f"--optimizer {args.optimizer} (planned {planned.optimizer or 'sgd'})")
    return found


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


def check(pipe, args) -> None:
    """Before the first step (see the module doc)."""
    peaks = planned_peaks(pipe.manifest)
    if peaks is None or not pipe.training:
        return
    args.user_module = pipe.user
    different = mismatch(pipe.manifest, args)
    if different:
        if pipe.rank == 0:
            say(pipe.rank, "note: the plan's memory figures are for other run options than "
                           f"{'; '.join(different)}: split again with them to check that the job fits")
        return
    entry = pipe.manifest["memory"]["ranks"][pipe.pp_rank]
    predicted = entry["peak_bytes"]
    if pipe.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(pipe.device)
        room = free + torch.cuda.memory_allocated(pipe.device)
        problem = None
        if predicted > room:
            problem = (f"rank {pipe.rank} (pipeline rank {pipe.pp_rank}) needs {size_text(predicted)} at its peak "
                       f"({entry.get('at', '')}: {_parts_text(entry.get('parts') or {})}) but {pipe.device} can give "
                       f"{size_text(room)} ({size_text(free)} free of {size_text(total)}, plus {size_text(room - free)} this rank holds): "
                       + _ways_out(pipe.manifest, pipe.pp_rank, room))
        _agree(pipe, problem)
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    available = _available_ram()
    if available is None:
        return
    per_host = max(peaks) * local  # the ranks on this host, each at most the largest peak
    if per_host > available:
        say(pipe.rank, f"warning: the {local} ranks on this host need about {size_text(per_host)} of tensors at their "
                       f"peaks (the plan's figures) and {size_text(available)} of RAM is available: the job may swap or "
                       f"be killed; " + _ways_out(pipe.manifest, pipe.pp_rank, available / max(local, 1)))


def _agree(pipe, problem) -> None:
    """Every rank stops if one does not fit (each says its own figures)."""
    flag = torch.tensor([1.0 if problem else 0.0], device=pipe.device)
    if pipe.world_size > 1:
        dist.all_reduce(flag)
    if problem:
        raise PipelineError(problem)
    if float(flag) > 0:
        error = PipelineError("another rank's predicted peak does not fit its device (it names the figures)")
        error.every_rank_agrees = False
        raise error


def _available_ram():
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
    different = mismatch(pipe.manifest, args)
    for item in gathered:
        entry = planned[item["pp_rank"]] if item["pp_rank"] < len(planned) else None
        item["predicted"] = None if entry is None or different else {
            "peak_bytes": entry["peak_bytes"], "parts": entry.get("parts"), "at": entry.get("at")}
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
