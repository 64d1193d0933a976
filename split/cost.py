"""Cost estimates for the split step: FLOPs and memory per node, per segment and per stage, and the choice of
cuts that balances them.

FLOPs are counted by torch's ``FlopCounterMode`` while the traced graph runs on fake tensors (the traced
metadata, no real compute, no parameter data), so this is cheap and exact for the ops torch counts (matmuls,
convolutions, attention); elementwise work is not counted. Memory is what a stage holds in training:
parameters, their gradients, the optimizer's state (Adam: two fp32 tensors per parameter unless told
otherwise), and the activations of one microbatch times the microbatches the schedule keeps in flight.
Every floating value that carries a gradient is counted as an activation kept for backward (an upper bound:
autograd frees some of them early).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from tracepp.split.pipeline_graph import Stage

ADAM_STATE_BYTES_PER_PARAM = 8  # exp_avg and exp_avg_sq, fp32 each
BACKWARD_FLOPS_FACTOR = 2  # backward of a matmul costs two matmuls (input and weight gradients)


def as_int(value) -> int:
    """A concrete int for a size or FLOP count that may be symbolic (dynamic shapes): its traced hint."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return int(value)


def tensor_bytes(val) -> int:
    """Bytes of one traced tensor value (fake or meta), 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for size in val.shape:
        numel *= as_int(size)
    return numel * val.element_size()


def _fake_mode_of(values: list):
    return next((v.fake_mode for v in values if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")), None)


def _fake_args(values: list) -> list:
    return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v
            for v in values]


class _CountingInterpreter(fx.Interpreter):
    """Runs a graph and records the FLOPs each node added to the surrounding FlopCounterMode."""

    def __init__(self, module, counter: FlopCounterMode):
        super().__init__(module)
        self.counter = counter
        self.flops_by_node: dict = {}

    def run_node(self, node):
        before = as_int(self.counter.get_total_flops())
        result = super().run_node(node)
        self.flops_by_node[node.name] = as_int(self.counter.get_total_flops()) - before
        return result


def node_flops(graph: fx.Graph) -> Optional[dict]:
    """Forward FLOPs of every node of a traced graph (node name -> int), or None if they cannot be counted."""
    values = [node.meta.get("val") for node in graph.nodes if node.op == "placeholder"]
    fake_mode = _fake_mode_of(values)
    if fake_mode is None:
        return None
    module = fx.GraphModule(torch.nn.Module(), graph)
    try:
        with fake_mode:
            args = _fake_args(values)
            with FlopCounterMode(display=False) as counter:
                interpreter = _CountingInterpreter(module, counter)
                interpreter.run(*args)
        return interpreter.flops_by_node
    except Exception:  # an op the fake run cannot take: no estimate rather than a failed split
        return None


def forward_flops(stage: Stage) -> Optional[int]:
    """FLOPs of the stage's forward for the traced microbatch, or None if they cannot be counted."""
    counted = node_flops(stage.graph)
    return None if counted is None else sum(counted.values())


def inflight_microbatches(schedule: Optional[str], stage_index: int, num_stages: int, num_microbatches: int,
                          training: bool = True) -> int:
    """Microbatches whose activations a stage keeps at once: all of them under GPipe, ``min(num_stages -
    stage_index, num_microbatches)`` under 1F1B and the schedules built on it (the first stage warms up the
    most); one in forward-only runs."""
    if not training:
        return 1
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage_index, num_microbatches)


@dataclass
class SegmentCost:
    """The cost of a run of nodes (a segment, or a whole stage) for one microbatch."""

    forward_flops: int = 0
    num_params: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0  # per microbatch

    def __add__(self, other: "SegmentCost") -> "SegmentCost":
        return SegmentCost(self.forward_flops + other.forward_flops, self.num_params + other.num_params,
                           self.param_bytes + other.param_bytes, self.activation_bytes + other.activation_bytes)


def stage_estimate(cost: SegmentCost, inflight: int, training: bool = True,
                   optimizer_bytes_per_param: int = ADAM_STATE_BYTES_PER_PARAM) -> dict:
    """Plain-data estimate of one stage: compute (forward and backward FLOPs) and the bytes it holds."""
    grad_bytes = cost.param_bytes if training else 0
    optimizer_bytes = cost.num_params * optimizer_bytes_per_param if training else 0
    activation_bytes = cost.activation_bytes * inflight
    flops = cost.forward_flops * ((1 + BACKWARD_FLOPS_FACTOR) if training else 1)
    return {"forward_flops": cost.forward_flops, "step_flops_per_microbatch": flops,
            "param_bytes": cost.param_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes,
            "activation_bytes_per_microbatch": cost.activation_bytes, "inflight_microbatches": inflight,
            "activation_bytes": activation_bytes,
            "memory_bytes": cost.param_bytes + grad_bytes + optimizer_bytes + activation_bytes}


def imbalance(amounts: list) -> Optional[float]:
    """max / mean of per-stage amounts (1.0 is perfect balance), None when there is nothing to compare."""
    if not amounts or not any(amounts):
        return None
    return max(amounts) / (sum(amounts) / len(amounts))


def choose_cuts(segments: list, num_stages: int, memory_of) -> list:
    """Where to cut a sequence of segments into ``num_stages`` contiguous non-empty stages.

    ``segments`` are SegmentCosts in execution order; ``memory_of(stage_index, cost)`` gives the bytes a stage
    with that summed cost holds. The cuts minimise the largest stage's FLOPs, and among equal ones the largest
    stage's memory (so an embedding, which has no counted FLOPs, still weighs). Returns the segment indices
    where stages 1..num_stages-1 begin. Dynamic programming over (stage, first segment): O(stages x segments^2).
    """
    count = len(segments)
    if num_stages > count:
        raise ValueError(f"cannot cut {count} segments into {num_stages} stages")
    prefix = [SegmentCost()]
    for segment in segments:
        prefix.append(prefix[-1] + segment)

    def span(start: int, end: int) -> SegmentCost:
        total, before = prefix[end], prefix[start]
        return SegmentCost(total.forward_flops - before.forward_flops, total.num_params - before.num_params,
                           total.param_bytes - before.param_bytes,
                           total.activation_bytes - before.activation_bytes)

    worst = (float("inf"), float("inf"))
    # best[stage_index][end]: (max flops, max memory) of stages 0..stage_index covering segments [0, end)
    best = [[worst] * (count + 1) for _ in range(num_stages)]
    cut_at = [[0] * (count + 1) for _ in range(num_stages)]
    for end in range(1, count + 1):
        cost = span(0, end)
        best[0][end] = (cost.forward_flops, memory_of(0, cost))
    for stage_index in range(1, num_stages):
        for end in range(stage_index + 1, count + 1):
            for start in range(stage_index, end):
                before = best[stage_index - 1][start]
                if before == worst:
                    continue
                cost = span(start, end)
                candidate = (max(before[0], cost.forward_flops), max(before[1], memory_of(stage_index, cost)))
                if candidate < best[stage_index][end]:
                    best[stage_index][end], cut_at[stage_index][end] = candidate, start
    cuts, end = [], count
    for stage_index in range(num_stages - 1, 0, -1):
        end = cut_at[stage_index][end]
        cuts.append(end)
    return sorted(cuts)
