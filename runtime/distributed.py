"""Process group set-up: NCCL on this rank's GPU where CUDA is available, gloo on CPU otherwise."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


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
