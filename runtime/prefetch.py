"""Batches on the device without a pageable copy inside the step (GPU ranks).

A step of a real-size stage takes hundreds of milliseconds; copying its batch from pageable host memory inside
the step cost 37 ms of a 500 ms step on an H100 (a 4 x 4096 x 4096 fp32 hidden-state batch, measured with
``benchmarks/studies/gpu_profile_stage.py``). :class:`BatchPrefetcher` produces the batch in the loop's own thread (in
order, so a ``batch(step)`` that draws from torch's global RNG sees exactly what it would without it), pins it,
and starts its host-to-device copy on a side CUDA stream before the step is timed; the step's stream waits for
that copy, so any part of it not yet done is counted in the step. Producing the next batch on a worker thread
while a step runs was measured too and was slower (0.51 to 0.76 s steps against 0.50 s): the model file's batch
code competes with the step's kernel launches for the interpreter. On CPU batches are used as produced.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree


class BatchPrefetcher:
    def __init__(self, produce, device: torch.device):
        """``produce(step) -> batch`` (any pytree of tensors)."""
        self.produce = produce
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def get(self, step: int):
        """``step``'s batch: on the device, being copied on the side stream, and safe to use on the current
        stream (GPU); as produced (CPU)."""
        batch = self.produce(step)
        if not self.cuda:
            return batch
        pinned = pytree.tree_map(lambda leaf: leaf.pin_memory() if isinstance(leaf, torch.Tensor)
                                 and leaf.device.type == "cpu" else leaf, batch)
        with torch.cuda.stream(self._stream):
            on_device = pytree.tree_map(lambda leaf: leaf.to(self.device, non_blocking=True)
                                        if isinstance(leaf, torch.Tensor) else leaf, pinned)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        for leaf in pytree.tree_leaves(on_device):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                leaf.record_stream(current)  # allocated on the side stream, used on this one
        return on_device
