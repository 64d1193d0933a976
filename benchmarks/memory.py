"""Peak memory of one training window, measured the same way in every benchmark worker.

* CUDA: ``torch.cuda.max_memory_allocated`` over the window (peak stats reset at its start), absolute:
  weights, gradients, optimizer state and activations held by the caching allocator's live tensors.
* CPU: growth of the resident set over the window: the kernel's high-water mark ``VmHWM`` is reset to the
  current RSS at the start (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), and the result is
  ``VmHWM(end) - VmRSS(start)``. Weights already loaded are in the baseline, so what is counted is what
  training adds: activations kept for backward, gradients, received/sent buffers, optimizer state, and the
  allocator's retained free memory. Where clear_refs is not writable the fallback is
  ``ru_maxrss(end) - RSS(start)``, which is a lower bound whenever set-up peaked above training (the method
  is recorded with every number).
"""
from __future__ import annotations

import json
import os
import resource

import torch

CPU_METHOD = "cpu: peak RSS growth over the training steps (VmHWM reset via /proc/self/clear_refs)"
CPU_FALLBACK = "cpu: ru_maxrss growth over the training steps (lower bound)"
CUDA_METHOD = "cuda: torch.cuda.max_memory_allocated during the training steps"


def _status_kb(field: str):
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.method = None
        self.base_kb = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = CUDA_METHOD
            return
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.method = CPU_METHOD
        except OSError:
            self.method = CPU_FALLBACK
        self.base_kb = _status_kb("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def stop(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {"peak_mb": torch.cuda.max_memory_allocated(self.device) / 2**20, "method": self.method}
        if self.method == CPU_METHOD:
            peak_kb = _status_kb("VmHWM")
        else:
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"peak_mb": max(0, peak_kb - self.base_kb) / 1024, "method": self.method}


def write_memory(directory: str, rank: int, result: dict) -> None:
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"mem_rank{rank}.json"), "w") as handle:
        json.dump(dict(result, rank=rank), handle)


def read_memory(directory: str) -> list:
    """Per-rank results written by :func:`write_memory`, sorted by rank."""
    found = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.startswith("mem_rank") and name.endswith(".json"):
                with open(os.path.join(directory, name)) as handle:
                    found.append(json.load(handle))
    return sorted(found, key=lambda r: r["rank"])


def cuda_device_or_die() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}). Run on a GPU machine, or use --device cpu.")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
