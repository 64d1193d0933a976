"""Process group set-up: NCCL on this rank's GPU where CUDA is available, gloo on CPU otherwise."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def missing_dependency(world: int):
    """What this Python lacks to run a job of ``world`` ranks, as a message naming the fix; None if nothing.

    torch.distributed exchanges Python objects between ranks (the start-up checks, checkpoints through
    torch.distributed.checkpoint, the saved state) by pickling them into tensors and reading them back with
    ``tensor.numpy()``: without numpy every rank of a multi-rank job dies at start-up with torch's bare
    "Numpy is not available". tracepp declares numpy; a folder copied to a machine with torch alone lands here."""
    if world <= 1:
        return None
    try:
        import numpy  # noqa: F401
    except ImportError as error:
        import sys

        return (f"numpy cannot be imported in this Python ({sys.executable}: {error}); torch.distributed needs it "
                f"to exchange objects between the {world} ranks. Install it there: {sys.executable} -m pip install "
                f"numpy (or pip install tracepp, which requires it)")
    return None


def init_distributed(rank: int, world: int, timeout_s: float, device=None):
    """(device, backend) for this rank; joins the default process group when torchrun started several ranks
    (or set MASTER_ADDR), unless one is already initialised. ``device`` overrides the choice."""
    if device is not None:
        device = torch.device(device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized() and (world > 1 or "MASTER_ADDR" in os.environ):
        kwargs = {"device_id": device} if backend == "nccl" else {}
        store = _attempt_store(world, timeout_s)
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    return device, backend


def _attempt_store(world: int, timeout_s: float):
    """After a torchrun restart (``--max-restarts``), the rendezvous store under its own prefix per attempt.

    torchrun's agent keeps one store for the whole job; a restarted worker group that joins the default process
    group through it reads the addresses the previous attempt's ranks published, and gloo connects to processes
    that are gone ("Connection refused" until the restarts run out). A prefix per attempt gives every attempt
    fresh keys. None on the first attempt (torch's own env:// rendezvous, unchanged)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if restart == "0" or not host or not port:
        return None
    store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return dist.PrefixStore(f"tracepp/attempt{restart}/", store)
