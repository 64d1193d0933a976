"""Checkpoints that resume: save and load parameters, optimizer state, step and RNG with torch.distributed.checkpoint.

Layout of ``--checkpoint-dir D``::

    D/step_6/              one complete checkpoint (written as D/step_6.tmp, renamed when complete)
        .metadata, *.distcp    torch.distributed.checkpoint files, every key under the original FQNs
        tracepp.json           model sha256, the FQN set, optimizer class, step, world size
        COMPLETE               the completion marker, written last before the rename

Keys: ``model.<fqn>`` (parameters and persistent buffers), ``optim.<fqn>.<state key>`` (e.g.
``optim.embed.weight.exp_avg``) and ``rng.rank<R>``. Each rank writes and reads only the FQNs its stages hold,
so a checkpoint written by one split loads into another split or rank count (a tied weight held by two ranks
is written once). The LR scheduler is restored by stepping a fresh one to the checkpoint's step (a schedule is
a function of the step count) and checked against the learning rates saved per FQN. RNG states are restored
when the rank count is the same.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil

import torch
import torch.distributed as dist

from .failure import PipelineError

MARKER = "COMPLETE"
INFO = "tracepp.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(PipelineError, ValueError):
    """A checkpoint that cannot be resumed from: the message names what differs."""


# -- finding ------------------------------------------------------------------------------------------------

def latest_checkpoint(directory: str):
    """(step, path) of the newest complete checkpoint in ``directory`` and the list of incomplete ones skipped
    (folders without the marker, ``.tmp`` leftovers). Raises CheckpointError when none is complete."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"--resume {directory}: no such folder; pass the --checkpoint-dir of an earlier run")
    complete, skipped = [], []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            complete.append((int(match.group(1)), path))
        elif name.startswith("step_"):
            skipped.append(path)
    if not complete:
        extra = f" (incomplete, ignored: {', '.join(skipped)})" if skipped else ""
        raise CheckpointError(f"--resume {directory}: no complete checkpoint (a step_N folder with a {MARKER} "
                              f"marker) in it{extra}; start without --resume, or point it at the --checkpoint-dir "
                              f"of a run that saved")
    step, path = max(complete)
    return step, path, skipped


# -- saving -------------------------------------------------------------------------------------------------

def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
         group=None) -> str:
    """Write checkpoint ``step`` (a collective: every rank calls it) atomically; returns its final path."""
    import torch.distributed.checkpoint as dcp

    final = os.path.join(directory, f"step_{step}")
    temporary = final + ".tmp"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)  # a leftover of a save killed earlier
    _barrier(group)
    flat = {f"model.{fqn}": tensor.detach() for fqn, tensor in named_state.items()}
    optim_groups = {}
    if optimizer is not None:
        state, optim_groups = optimizer_state_by_fqn(optimizer, fqns)
        flat.update({f"optim.{key}": value for key, value in state.items()})
    flat[f"rng.rank{rank}"] = pickle.dumps(_rng_state())  # bytes: one opaque entry per rank
    dcp.save(flat, checkpoint_id=temporary)
    gathered = _gather(optim_groups, group)
    if rank == 0:
        merged_groups = {}
        for part in gathered:
            merged_groups.update(part)
        record = dict(info, step=step, param_groups=merged_groups)
        with open(os.path.join(temporary, INFO), "w") as handle:
            json.dump(record, handle, indent=1, sort_keys=True, default=str)
        with open(os.path.join(temporary, MARKER), "w") as handle:
            handle.write(f"step {step}\n")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(temporary, final)
    _barrier(group)
    return final


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


def prepare_load(path: str, named_state: dict, optimizer, fqns: list, rank: int, same_world: bool) -> dict:
    """Check this rank's parameters and optimizer against checkpoint ``path`` (no communication) and return
    what :func:`load` reads: destination tensors keyed as in the checkpoint. Raises CheckpointError."""
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
        flat[f"model.{fqn}"] = tensor.detach()
    optimizer_keys = {}
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
    if same_world and rng_key in metadata:
        flat[rng_key] = b""
    return {"path": path, "flat": flat, "optimizer_keys": optimizer_keys, "rng_key": rng_key}


def load(prepared: dict, optimizer, fqns: list) -> None:
    """Read a :func:`prepare_load` result (a collective: every rank calls it): parameters in place, then the
    optimizer state and this rank's RNG state."""
    import torch.distributed.checkpoint as dcp

    flat = prepared["flat"]
    dcp.load(flat, checkpoint_id=prepared["path"])
    if optimizer is not None and prepared["optimizer_keys"]:
        _load_optimizer(prepared["path"], optimizer, fqns, flat, prepared["optimizer_keys"])
    if flat.get(prepared["rng_key"]):
        _set_rng_state(pickle.loads(flat[prepared["rng_key"]]))


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
