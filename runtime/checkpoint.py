"""Checkpoints that resume: save and load parameters, optimizer state, step and RNG with torch.distributed.checkpoint.

Layout of ``--checkpoint-dir D``::

    D/step_6/              one complete checkpoint (written as D/step_6.tmp, renamed when complete)
        .metadata, *.distcp    torch.distributed.checkpoint files, every key under the original FQNs
        tracepp.json           model sha256, the FQN set, optimizer class, step, world size, the training
                               data's record, and every file's size and CRC-32
        COMPLETE               the completion marker, written last before the rename

Keys: ``model.<fqn>`` (parameters and persistent buffers), ``optim.<fqn>.<state key>`` (e.g.
``optim.embed.weight.exp_avg``) and this rank's RNG as tensors and plain numbers (``rng.rank<R>.torch``, ``.cuda``:
the generators' byte states; ``.python``: Python's 625 state words, ``.python_version``, ``.python_gauss``), no
object pickled by tracepp. (DCP itself reads its metadata and any non-tensor entry with pickle: a checkpoint
folder is trusted input, docs/long-jobs.md.) Each rank writes and reads only the FQNs its stages hold,
so a checkpoint written by one split loads into another split or rank count (a tied weight held by two ranks
is written once). The LR scheduler is restored by stepping a fresh one to the checkpoint's step (a schedule is
a function of the step count) and checked against the learning rates saved per FQN. RNG states are restored
when the rank count is the same.

A checkpoint is trusted only after it is verified (:func:`usable`): every file's size and CRC-32 against the
record written at save (the ranks share the reading); a damaged latest checkpoint is named and the previous
complete one used. ``keep_last`` deletes older complete checkpoints only once a newer one is complete, and a
save that fails (a full disk) removes its partial folder and leaves the previous checkpoints as they were.
"""
from __future__ import annotations

import json
import os
import math
import random
import re
import shutil
import zlib

import torch
import torch.distributed as dist

from .failure import PipelineError

MARKER = "COMPLETE"
INFO = "tracepp.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(PipelineError, ValueError):
    """A checkpoint that cannot be resumed from: the message names what differs."""


# -- finding ------------------------------------------------------------------------------------------------

def scan(directory: str) -> tuple:
    """([(step, path)] of the complete checkpoints in ``directory``, [paths of incomplete ones]) (folders without
    the marker, ``.tmp`` leftovers of a save that was cut off); both empty when the folder does not exist."""
    complete, skipped = [], []
    if not os.path.isdir(directory):
        return complete, skipped
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            complete.append((int(match.group(1)), path))
        elif name.startswith("step_"):
            skipped.append(path)
    return sorted(complete), skipped


def latest_checkpoint(directory: str):
    """(step, path) of the newest complete checkpoint in ``directory`` and the list of incomplete ones skipped
    (folders without the marker, ``.tmp`` leftovers). Raises CheckpointError when none is complete."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"--resume {directory}: no such folder; pass the --checkpoint-dir of an earlier run")
    complete, skipped = scan(directory)
    if not complete:
        extra = f" (incomplete, ignored: {', '.join(skipped)})" if skipped else ""
        raise CheckpointError(f"--resume {directory}: no complete checkpoint (a step_N folder with a {MARKER} "
                              f"marker) in it{extra}; start without --resume, or point it at the --checkpoint-dir "
                              f"of a run that saved")
    step, path = max(complete)
    return step, path, skipped


def _crc32(path: str) -> int:
    value = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            value = zlib.crc32(chunk, value)
    return value


def _share(names: list, rank: int, world: int) -> list:
    """The files this rank checksums: every ``world``-th of the sorted names (the ranks share the reading)."""
    return sorted(names)[rank::world]


def verify(path: str, rank: int = 0, world: int = 1):
    """What is wrong with checkpoint ``path`` in this rank's share of its files (a message naming the file and
    the numbers), or None. A checkpoint written before files were recorded is checked for its record only."""
    try:
        info = read_info(path)
    except (OSError, ValueError) as error:
        return f"{INFO} cannot be read ({type(error).__name__}: {error})"
    files = info.get("files")
    if files is None:
        return None
    for name in _share(list(files), rank, world):
        size, crc = files[name]
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        found = os.path.getsize(file)
        if found != size:
            return f"{name} has {found} bytes, {size} were written"
        if _crc32(file) != crc:
            return f"{name} has the recorded size ({size} bytes) but not the recorded CRC-32 (its bytes changed)"
    return None


def usable(directory: str, rank: int, world: int, group=None, report=print):
    """(step, path) of the newest complete checkpoint of ``directory`` whose files verify, or None when there is
    no complete checkpoint (a first start). A collective: every rank checks its share of each candidate's files
    and all agree. A damaged checkpoint is reported (``report``, on rank 0) and the previous one tried; when
    every complete checkpoint is damaged, CheckpointError."""
    complete, incomplete = scan(directory)
    if rank == 0:
        for path in incomplete:
            report(f"ignoring incomplete checkpoint {path} (no {MARKER} marker: its save was cut off)")
    damaged = []
    for step, path in reversed(complete):
        problems = [p for p in _gather(verify(path, rank, world), group) if p]
        if not problems:
            if damaged and rank == 0:
                report(f"warning: resuming from {path}, the newest checkpoint that verifies")
            return step, path
        damaged.append(f"{path}: {problems[0]}")
        if rank == 0:
            report(f"warning: checkpoint {path} is damaged ({problems[0]}); trying the one before it")
    if damaged:
        raise CheckpointError(f"--resume {directory}: no usable checkpoint, every complete one is damaged "
                              f"({'; '.join(damaged)}). Restore one from a backup, or move them away to start from "
                              f"step 0")
    return None


# -- saving -------------------------------------------------------------------------------------------------

def _rng_entries(rank: int) -> dict:
    """This rank's RNG states as checkpoint entries: tensors (torch's and CUDA's byte states, Python's state
    words as int64) and plain numbers (Python's version and its cached Gaussian, NaN when there is none)."""
    version, words, gauss = random.getstate()
    key = f"rng.rank{rank}"
    entries = {f"{key}.torch": torch.get_rng_state(), f"{key}.python": torch.tensor(words, dtype=torch.int64),
               f"{key}.python_version": int(version), f"{key}.python_gauss": math.nan if gauss is None else gauss}
    if torch.cuda.is_available():
        entries[f"{key}.cuda"] = torch.cuda.get_rng_state()
    return entries


def _set_rng_state(flat: dict, key: str) -> None:
    torch.set_rng_state(flat[f"{key}.torch"])
    gauss = flat[f"{key}.python_gauss"]
    random.setstate((int(flat[f"{key}.python_version"]), tuple(int(w) for w in flat[f"{key}.python"].tolist()),
                     None if math.isnan(gauss) else float(gauss)))
    if f"{key}.cuda" in flat and torch.cuda.is_available():
        torch.cuda.set_rng_state(flat[f"{key}.cuda"])


def optimizer_state_by_fqn(optimizer, fqns: list) -> tuple:
    """(``{"<fqn>.<key>": value}`` of the per-parameter state, ``{fqn: group hyperparameters}``)."""
    raw = optimizer.state_dict()
    state, groups = {}, {}
    index = 0
    for group in raw["param_groups"]:
        settings = {k: v for k, v in group.items() if k != "params"}
        for param_id in group["params"]:
            fqn = fqns[index]
            index += 1
            groups[fqn] = settings
            for key, value in raw["state"].get(param_id, {}).items():
                state[f"{fqn}.{key}"] = value
    return state, groups


def save(directory: str, step: int, named_state: dict, optimizer, fqns: list, info: dict, rank: int,
         group=None, keep_last: int = 0, view=None) -> str:
    """Write checkpoint ``step`` (a collective: every rank calls it) atomically; returns its final path. The
    files' sizes and CRC-32s go into its record (each rank checksums a share); ``keep_last`` > 0 then deletes
    all but the newest ``keep_last`` complete checkpoints. A failed write (a full disk) removes the partial
    folder, leaves the earlier checkpoints alone and raises CheckpointError on every rank. ``view(fqn, tensor)``
    gives what DCP writes of a parameter and of its optimizer state (a tensor-parallel fused projection in the
    model's own layout: ``tensor_parallel.checkpoint_view``)."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(directory, f"step_{step}")
    temporary = final + ".tmp"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)  # a leftover of a save killed earlier
    _barrier(group)
    view = view or (lambda _fqn, tensor: tensor)
    flat = {f"model.{fqn}": view(fqn, tensor.detach()) for fqn, tensor in named_state.items()}
    optim_groups = {}
    if optimizer is not None:
        state, optim_groups = optimizer_state_by_fqn(optimizer, fqns)
        shapes = {fqn: tuple(tensor.shape) for fqn, tensor in named_state.items()}
        for key, value in state.items():
            fqn = key.rpartition(".")[0]
            if isinstance(value, torch.Tensor) and shapes.get(fqn) == tuple(value.shape):
                value = view(fqn, value)
            flat[f"optim.{key}"] = value
    flat.update(_rng_entries(rank))  # tensors and plain numbers, under this rank's keys
    problem, sums = None, {}
    try:
        dcp.save(flat, checkpoint_id=temporary)
    except BaseException as error:  # DCP's CheckpointException is a BaseException; it carries each rank's error
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        problem = _write_failure(error)
    _barrier(group)
    if problem is None:
        try:
            world = dist.get_world_size(group) if dist.is_initialized() else 1
            sums = {name: [os.path.getsize(os.path.join(temporary, name)), _crc32(os.path.join(temporary, name))]
                    for name in _share(os.listdir(temporary), rank, world)}
        except OSError as error:
            problem = _write_failure(error)
    parts = _gather((optim_groups, sums, problem), group)
    problem = next((p for _g, _s, p in parts if p), None)
    if rank == 0 and problem is None:
        try:
            _complete(temporary, final, dict(info, step=step), parts)
        except OSError as error:
            problem = _write_failure(error)
    if rank == 0 and problem is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    problem = _gather(problem, group)[0]  # rank 0's outcome, for every rank
    if problem is not None:
        complete, _incomplete = scan(directory)
        kept = f"the previous checkpoint {complete[-1][1]} is intact" if complete else "no earlier checkpoint exists"
        error = CheckpointError(f"checkpoint {final} could not be written: {problem}. The partial save was removed "
                                f"and {kept}. Free space in {directory} (or pass --keep-last K), or save to another "
                                f"--checkpoint-dir")
        error.every_rank_agrees = True
        raise error
    if rank == 0 and keep_last > 0:
        prune(directory, keep_last)
    _barrier(group)
    return final


def _complete(temporary: str, final: str, record: dict, parts: list) -> None:
    """Rank 0: the record (with every file's size and CRC-32), the marker, then the rename that publishes it."""
    groups, files = {}, {}
    for part_groups, part_sums, _problem in parts:
        groups.update(part_groups)
        files.update(part_sums)
    record = dict(record, param_groups=groups, files=files)
    with open(os.path.join(temporary, INFO), "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True, default=str)
    with open(os.path.join(temporary, MARKER), "w") as handle:
        handle.write(f"step {record['step']}\n")
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(temporary, final)


def _write_failure(error: BaseException) -> str:
    """A failed write, said plainly: the OS error of the first rank that had one (DCP wraps them per rank)."""
    import errno as errno_codes

    found = []

    def walk(item, where=""):
        if isinstance(item, OSError):
            found.append((item, where))
        elif isinstance(item, BaseException):
            for rank, inner in (getattr(item, "failures", None) or {}).items():
                walk(inner, f" (rank {rank})")
            walk(item.__cause__ or item.__context__, where)
        elif isinstance(item, (tuple, list)):
            for inner in item:
                walk(inner, where)
    walk(error)
    if not found:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    os_error, where = found[0]
    names = {errno_codes.ENOSPC: "no space left on device", errno_codes.EFBIG: "file too large for this file system "
             "or process limit", getattr(errno_codes, "EDQUOT", -1): "disk quota exceeded"}
    reason = names.get(os_error.errno, os_error.strerror or str(os_error))
    return f"{reason}{where} ({type(os_error).__name__}: {os_error})"


def prune(directory: str, keep_last: int) -> list:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``directory``; returns the deleted paths.
    Incomplete folders are left for a resume to report."""
    complete, _incomplete = scan(directory)
    deleted = [path for _step, path in complete[:-keep_last]] if keep_last > 0 else []
    for path in deleted:
        os.remove(os.path.join(path, MARKER))  # first: a deletion cut off leaves an incomplete folder, not a damaged one
        shutil.rmtree(path)
    return deleted


def _gather(obj, group) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj, group=group)
    return parts


def _barrier(group) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


# -- loading ------------------------------------------------------------------------------------------------

def read_info(path: str) -> dict:
    with open(os.path.join(path, INFO)) as handle:
        return json.load(handle)


def check_compatible(path: str, saved: dict, current: dict) -> None:
    """The same model (FQN set, shapes) and optimizer class, else CheckpointError naming the difference."""
    saved_fqns, fqns = set(saved["fqns"]), set(current["fqns"])
    if saved_fqns != fqns:
        missing, extra = sorted(fqns - saved_fqns), sorted(saved_fqns - fqns)
        raise CheckpointError(
            f"checkpoint {path} is from another model (model file sha256 {saved['model_sha256'][:16]}, this "
            f"one {current['model_sha256'][:16]}): parameters missing from it: {missing[:8] or 'none'}; only in "
            f"it: {extra[:8] or 'none'}. Resume from a checkpoint of this model, or start without --resume")
    if saved["optimizer"] != current["optimizer"]:
        raise CheckpointError(
            f"checkpoint {path} holds {saved['optimizer']} optimizer state but this run builds "
            f"{current['optimizer']}: use the same optimizer (model file optimizer(...) or --optimizer) as the "
            f"run that wrote it, or start without --resume")


def prepare_load(path: str, named_state: dict, optimizer, fqns: list, rank: int, same_world: bool,
                 view=None) -> dict:
    """Check this rank's parameters and optimizer against checkpoint ``path`` (no communication) and return
    what :func:`load` reads: destination tensors keyed as in the checkpoint (``view``: as :func:`save`). Raises
    CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    flat = {}
    for fqn, tensor in named_state.items():
        entry = metadata.get(f"model.{fqn}")
        if entry is None or tuple(entry.size) != tuple(tensor.shape):
            found = "missing" if entry is None else f"shape {list(entry.size)}"
            raise CheckpointError(f"checkpoint {path}: {fqn} is {found}, this model has shape {list(tensor.shape)}; "
                                  f"resume from a checkpoint of this model")
        flat[f"model.{fqn}"] = view(fqn, tensor.detach()) if view else tensor.detach()
    optimizer_keys = {}
    destinations = {}  # optimizer state read through a view: the tensor the optimizer gets
    if optimizer is not None:
        by_fqn = dict(zip(fqns, (p for g in optimizer.param_groups for p in g["params"])))
        for key, entry in metadata.items():
            if not key.startswith("optim."):
                continue
            fqn, state_key = _split_state_key(key[len("optim."):], by_fqn)
            if fqn is None:
                continue
            param = by_fqn[fqn]
            if isinstance(entry, TensorStorageMetadata):
                if entry.size and tuple(entry.size) != tuple(param.shape):
                    raise CheckpointError(
                        f"checkpoint {path}: optimizer state {state_key!r} of {fqn} has shape {list(entry.size)} "
                        f"but the parameter has shape {list(param.shape)}: the optimizer state does not match "
                        f"the parameters; resume from a checkpoint of this model")
                if hasattr(param, "device_mesh") and tuple(entry.size) == tuple(param.shape):
                    # data parallel (FSDP/DDP DTensor parameters): DCP loads each rank's shard of the state
                    from torch.distributed.tensor import empty as dtensor_empty
                    flat[key] = dtensor_empty(*entry.size, dtype=entry.properties.dtype,
                                              device_mesh=param.device_mesh, placements=param.placements)
                    if view is not None:
                        destinations[key] = flat[key]
                        flat[key] = view(fqn, flat[key])
                else:
                    flat[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device=param.device)
            else:
                flat[key] = b""
            optimizer_keys.setdefault(fqn, []).append(state_key)
        missing = [fqn for fqn in fqns if fqn not in optimizer_keys]
        if missing and len(missing) < len(fqns):
            raise CheckpointError(f"checkpoint {path}: no optimizer state for {missing[:8]} while other parameters "
                                  f"have some: the optimizer state does not match the parameters")
    rng_key = f"rng.rank{rank}"
    if same_world and f"{rng_key}.torch" in metadata:
        for key, entry in metadata.items():
            if key.startswith(rng_key + "."):
                flat[key] = (torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                             if isinstance(entry, TensorStorageMetadata) else 0)
    return {"path": path, "flat": flat, "optimizer_keys": optimizer_keys, "rng_key": rng_key,
            "destinations": destinations}


def load(prepared: dict, optimizer, fqns: list) -> None:
    """Read a :func:`prepare_load` result (a collective: every rank calls it): parameters in place, then the
    optimizer state and this rank's RNG state."""
    import torch.distributed.checkpoint as dcp

    flat = prepared["flat"]
    dcp.load(flat, checkpoint_id=prepared["path"])
    flat.update(prepared.get("destinations", {}))  # the DTensors the views wrote into
    if optimizer is not None and prepared["optimizer_keys"]:
        _load_optimizer(prepared["path"], optimizer, fqns, flat, prepared["optimizer_keys"])
    if f"{prepared['rng_key']}.torch" in flat:
        _set_rng_state(flat, prepared["rng_key"])


def _split_state_key(text: str, by_fqn: dict):
    """``"layers.0.fc.weight.exp_avg"`` -> (``"layers.0.fc.weight"``, ``"exp_avg"``) for a FQN of this rank."""
    fqn, _dot, state_key = text.rpartition(".")
    return (fqn, state_key) if fqn in by_fqn else (None, None)


def _load_optimizer(path: str, optimizer, fqns: list, flat: dict, optimizer_keys: dict) -> None:
    current = optimizer.state_dict()
    state = {}
    index = 0
    for group in current["param_groups"]:
        for param_id in group["params"]:
            fqn = fqns[index]
            index += 1
            keys = optimizer_keys.get(fqn, [])
            state[param_id] = {key: flat[f"optim.{fqn}.{key}"] for key in keys}
    try:
        optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {path}: its optimizer state does not load into this optimizer "
                              f"({type(optimizer).__name__}): {error}") from error
