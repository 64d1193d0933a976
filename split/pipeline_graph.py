"""The split step's result, as plain data: what each stage computes, owns, receives and sends."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

AUTOCAST_OFF = "tracepp_autocast_off"  # node meta: inlined from a torch.autocast(enabled=False) region
# parameter placeholder meta under --mixed-precision params: the dtype the rank holds it in (its master weight, fp32),
# where the program was traced with it cast to the compute dtype (bf16): what it costs to hold, not to compute with
MASTER_DTYPE = "tracepp_master_dtype"


@dataclass
class TensorMeta:
    """Static metadata of one value that crosses a stage boundary (or enters from the batch)."""

    shape: list  # ints, or strings of sympy expressions over the root symbols (e.g. "s_seq*s_batch")
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32", "int64", "bool"
    requires_grad: bool  # carries a gradient back in training (never for integer/bool tensors)

    def to_json(self) -> dict:
        return {"shape": [d if isinstance(d, int) else str(d) for d in self.shape], "dtype": self.dtype,
                "requires_grad": self.requires_grad}


@dataclass
class BoundaryValue:
    """A value produced on one stage and used on later ones (skip connections reach several)."""

    name: str  # the traced node's name, unique in the program
    producer: int
    consumers: list  # stage indices, ascending
    meta: TensorMeta


@dataclass
class StateRef:
    """A parameter, buffer or constant a stage reads, with every FQN that names the same tensor."""

    placeholder: str  # the traced placeholder's name (also the stage function's argument name)
    fqn: str  # the FQN export recorded
    aliases: list  # all FQNs of this tensor in the original model (tied weights have several)
    kind: str  # "parameter" | "buffer" | "constant"
    persistent: bool = True
    stages: list = field(default_factory=list)  # every stage that reads it (shared when more than one)
    trainable: bool = True  # a parameter the optimizer updates (False: frozen, ``requires_grad=False``)


@dataclass
class RootInput:
    """One flattened leaf of the model's (args, kwargs) that the graph reads as a placeholder."""

    placeholder: str
    leaf_index: int  # position among pytree.tree_flatten((args, kwargs)) leaves
    path: str  # human-readable: "args[0]", "kwargs['attention_mask']"
    batched: bool  # chunked along dim 0 into microbatches
    meta: Optional[TensorMeta]  # None for non-tensor leaves (constants baked into the trace)
    stages: list = field(default_factory=list)


@dataclass
class Stage:
    index: int
    graph: torch.fx.Graph  # placeholders: state refs, then root inputs, then received values
    state: list  # placeholder names of StateRefs, in argument order
    root_inputs: list  # placeholder names of RootInputs, in argument order
    received: list  # (producer stage, value name), in argument order
    outputs: list  # value names this stage returns, in order (last stage: the model's output leaves)
    module_fqns: list  # modules whose code runs in this stage (from nn_module_stack), in first-seen order
    sym_inputs: list = field(default_factory=list)  # (name, python expression over root symbols), after received
    estimate: dict = field(default_factory=dict)  # split.cost.stage_estimate: FLOPs, bytes held, recomputed values


@dataclass
class PipelineGraph:
    stages: list  # list[Stage]
    values: dict  # name -> BoundaryValue
    state: dict  # placeholder name -> StateRef
    root_inputs: dict  # placeholder name -> RootInput
    num_leaves: int  # flattened (args, kwargs) leaves of one batch
    in_spec: Any  # pytree spec of (args, kwargs)
    out_spec: Any  # pytree spec of the model's output
    output_leaves: list  # per output leaf: ("value", name) | ("const", python value)
    unused_state: dict  # FQN -> tensor for parameters/buffers no stage reads (kept for --save)
    symbols: dict = field(default_factory=dict)  # root symbol name -> {"min": int, "max": int|None, "source": str}
    batch_symbol: Optional[str] = None  # the symbol of the batch dim of batched inputs, when dynamic
    symbol_aliases: dict = field(default_factory=dict)  # export's symbol name ("s95") -> ours ("s_batch")
    recomputed: dict = field(default_factory=dict)  # value name -> {"producer": stage, "stages": [stages that
    #                                                 make it again from root inputs and buffers instead of receiving it]}
    segments: list = field(default_factory=list)  # split.partition.segment_table: where a re-split may cut, and
    #                                               what each piece costs (the tuner prices other splits with it)
    flop_count: dict = field(default_factory=dict)  # split.cost.FlopCount.record(): ops counted as 0 for want of a
    #                                                 formula, ops that could not be priced, assumed sizes
    flop_warnings: list = field(default_factory=list)  # one line per op without a FLOP formula
    tensor_parallel: dict = field(default_factory=dict)  # split.tensor_parallel.TPPlan.to_json() with --tp
    expert_parallel: dict = field(default_factory=dict)  # split.expert_parallel.EPPlan.to_json(): routed experts
    memory: dict = field(default_factory=dict)  # codegen.memory.plan_memory: figures per stage, peak per rank
    context_parallel: dict = field(default_factory=dict)  # split.context_parallel.CPPlan.to_json() with --cp
    loss: Any = None  # with --cp: the model file's loss_fn traced and rewritten (split.context_parallel.LossGraph)
    token_mean: Any = None  # the loss a mean over the tokens not ignored: how to count them (split.token_mean)
    batch_dim: int = 0  # the dim of a batched input holding its samples (the model file's batch_dim; 1: [seq, batch])
    whole: Any = None  # split.partition._Whole: the whole traced graph as the split read it (split.partition.
    #                    tuner_figures walks it; in memory only, never written)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def edges(self) -> list:
        """(producer, consumer, [value names]) per stage pair that exchanges data, in a fixed order."""
        pairs: dict = {}
        for value in self.values.values():
            for consumer in value.consumers:
                pairs.setdefault((value.producer, consumer), []).append(value.name)
        return [(p, c, names) for (p, c), names in sorted(pairs.items())]

    def shared_state(self) -> list:
        """Parameters held by several stages (their gradients are summed); buffers are read-only copies."""
        return [ref for ref in self.state.values() if len(ref.stages) > 1 and ref.kind == "parameter"]
