"""Cost estimates per stage: forward FLOPs of one microbatch, counted by torch's FlopCounterMode.

The stage graph runs on fake tensors (the traced metadata, no real compute), so this is cheap and exact for
the ops torch counts (matmuls, convolutions, attention); elementwise work is not counted.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from tracepp.split.pipeline_graph import Stage


def forward_flops(stage: Stage) -> Optional[int]:
    """FLOPs of the stage's forward for the traced microbatch, or None if they cannot be counted."""
    values = [node.meta.get("val") for node in stage.graph.nodes if node.op == "placeholder"]
    fake_mode = next((v.fake_mode for v in values if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        return None
    module = torch.fx.GraphModule(torch.nn.Module(), stage.graph)
    try:
        with fake_mode:
            args = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                    for v in values]
            with FlopCounterMode(display=False) as counter:
                module(*args)
        total = counter.get_total_flops()
        return int(total.node.hint) if isinstance(total, torch.SymInt) else int(total)
    except Exception:  # an op the fake run cannot take: no estimate rather than a failed split
        return None
