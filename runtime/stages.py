"""This rank's stages as ``nn.Module``s: parameters and buffers registered under the original model's FQNs.

A :class:`StageModule` holds the tensors one stage reads (``embed.weight`` is the parameter ``weight`` of the
child module ``embed``) and calls the generated stage function with them, so ``named_parameters()`` gives the
original FQNs and ``fully_shard``, DDP, activation checkpointing and ``torch.compile`` apply to a stage as to
any module. Stages on one rank that read the same weight (a tied embedding and head) hold one ``Parameter``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def _owner(root: nn.Module, fqn: str):
    """The child module of ``root`` that holds ``fqn`` (created on the way), and the attribute name."""
    *path, name = fqn.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, name


class StageModule(nn.Module):
    """One pipeline stage: ``forward(*root_inputs, *received, *sizes)`` runs the generated stage function with
    this module's own parameters and buffers (read at call time, so wrappers that swap them still apply)."""

    def __init__(self, spec: dict, function, state_by_fqn: dict):
        super().__init__()
        self.stage_index = spec["index"]
        self.function = function
        self.autocast_dtype = None  # set by the Pipeline for --mixed-precision autocast
        # --mixed-precision params without an FSDP/DDP engine casting them (precision.CastWeights): the compute
        # copies of the parameters, made once per step
        self.cast_weights = None
        self.local_shards = False  # tensor parallel: parameters are DTensors over tp, the function takes shards
        # activation checkpointing (recompute.apply): False, "full" (keep the inputs, recompute the forward in
        # backward) or "selective" (keep the matmul, attention and collective outputs, recompute the rest)
        self.recompute = False
        self.recompute_blocks = False  # checkpoint its block calls one by one (recompute.wrap_blocks)
        self.sequence_shards = False  # sequence parallel: backward keeps the shards of gathered inputs
        self.context_shards = False  # context parallel: backward keeps this rank's shard of gathered keys/values
        self.device_type = next((t.device.type for t in state_by_fqn.values()), "cpu")
        self._state_paths = []
        self.state_fqns = [ref["fqn"] for ref in spec["state"]]  # beside _state_paths, in the function's order
        for ref in spec["state"]:
            owner, name = _owner(self, ref["fqn"])
            tensor = state_by_fqn[ref["fqn"]]
            if name not in owner._parameters and name not in owner._buffers:
                if isinstance(tensor, nn.Parameter):
                    owner.register_parameter(name, tensor)
                else:
                    persistent = ref["kind"] == "buffer" and ref.get("persistent", True)
                    owner.register_buffer(name, tensor, persistent=persistent)
            self._state_paths.append((owner, name))

    def state_tensors(self) -> list:
        """The tensors the stage function takes first, in the order of its parameters (with tensor parallelism,
        this rank's shards: the stage function computes on plain local tensors). A parameter is read from its
        owner's ``_parameters`` (where ``fully_shard`` swaps its unsharded one in; ``getattr`` reads it there too,
        through ``nn.Module.__getattr__``: two Python calls per tensor and microbatch); buffers, and a name shadowed
        by a plain attribute (``torch.func.functional_call``), with ``getattr``."""
        tensors = [owner._parameters[name] if name in owner._parameters and name not in owner.__dict__
                   else getattr(owner, name) for owner, name in self._state_paths]
        if self.cast_weights is not None:
            tensors = self.cast_weights.swap(tensors)
        if self.local_shards:
            tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return tensors

    def compute_parameters(self) -> list:
        """The trainable tensors a backward of this step reaches: the compute copies where :class:`CastWeights
        <tracepp.runtime.precision.CastWeights>` holds them, else the parameters as the module holds them now (under
        FSDP, the unsharded ones it swapped in)."""
        params = [p for p in self.parameters() if p.requires_grad]
        cast = self.cast_weights
        if cast is None or cast.copies is None:
            return params
        return [cast.copies[cast.slot[id(p)]] if id(p) in cast.slot else p for p in params]

    def weights_used(self, release: bool) -> None:
        """After a backward (or the step's last use of the weights, ``release``): the compute copies' gradients
        added into the fp32 masters' and, with ``release``, the copies dropped."""
        if self.cast_weights is not None:
            (self.cast_weights.release if release else self.cast_weights.accumulate)()

    def forward(self, *inputs):
        if self.autocast_dtype is None:
            context = contextlib.nullcontext()
        else:
            context = torch.autocast(self.device_type, dtype=self.autocast_dtype)
        if self.sequence_shards and torch.is_grad_enabled() and not self.recompute:
            from .tensor_parallel import shards_kept_for_backward

            context_shards = shards_kept_for_backward()
        else:
            context_shards = contextlib.nullcontext()
        if self.context_shards and torch.is_grad_enabled() and not self.recompute:
            from .context_parallel import kv_shards_kept_for_backward

            kv_shards = kv_shards_kept_for_backward()
        else:
            kv_shards = contextlib.nullcontext()
        with context, context_shards, kv_shards:
            if self.recompute and torch.is_grad_enabled() and self.recompute_blocks:
                from .recompute import blocks_checkpointed

                with blocks_checkpointed(self.recompute):
                    return self.function(*self.state_tensors(), *inputs)
            if self.recompute and torch.is_grad_enabled():
                if self.recompute == "selective":
                    from .recompute import selective_context

                    return checkpoint(self.function, *self.state_tensors(), *inputs, use_reentrant=False,
                                      context_fn=selective_context)
                return checkpoint(self.function, *self.state_tensors(), *inputs, use_reentrant=False)
            return self.function(*self.state_tensors(), *inputs)
