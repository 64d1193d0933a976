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
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    return device, backend
