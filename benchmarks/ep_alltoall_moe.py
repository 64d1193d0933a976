"""The expert layer the expert-parallel step benchmark sets tracepp against: routed experts over an ep group as
torchtitan writes them, put in place of Hugging Face Mixtral's ``MixtralExperts`` (``benchmarks/ep_torch_worker.py``).

torchtitan's MoE (``torchtitan/models/common/moe.py``, 0.3.0) computes a block of routed experts as
``RoutedExperts``: ``token_dispatcher.dispatch`` (sort the (token, expert) pairs by expert, exchange the per-expert
counts with one ``all_to_all_single`` first, turn them into split sizes on the host, ``all_to_all_single`` of the
rows with those splits, regroup the received rows from rank-major to expert-major), ``GroupedExperts`` (grouped
matmuls on this rank's experts: ``silu(x W1) * (x W3)``, then ``W2``, by ``torch._grouped_mm`` with per-expert
offsets), ``token_dispatcher.combine`` (undo the regrouping, ``all_to_all_single`` back, weight each row by its
router score in fp32, ``scatter_add`` into the tokens). This module runs that with:

* ``dispatcher="torchtitan"``: torchtitan's own ``AllToAllTokenDispatcher`` (imported from an installed
  ``torchtitan``; its collectives through torch's functional ``all_to_all_single``, ``set_spmd_backend("dtensor")``),
* ``dispatcher="rewrite"``: :class:`AllToAllDispatcher` below, the same steps written out here (for a machine
  without torchtitan); the benchmark checks it against torchtitan's where both import.

Departures from torchtitan, each to train the same parameters as Hugging Face's model: the expert weights keep
Mixtral's layout and names (``gate_up_proj`` [E, 2I, H] fused, ``down_proj`` [E, H, I]: W1 and W3 are its two halves)
and this rank holds rows ``[r E / ep, (r + 1) E / ep)`` of each; the grouped matmuls run in the weights' dtype
(torchtitan's ``GroupedExperts`` casts to bf16 for the GPU kernel); the router is Mixtral's own (softmax, top-k,
renormalised), left untouched. ``grouped_mm="fallback"`` runs transformers' per-expert loop
(``transformers::grouped_mm_fallback``) instead of ``torch._grouped_mm``: the kernel Hugging Face's Mixtral calls
when it is traced (``torch.export`` counts as compiling, and transformers falls back for fp32 there), so tracepp's
rank scripts call it; eager Hugging Face and torchtitan call ``grouped_mm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _all_to_all(tensor: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    """torch's functional ``all_to_all_single``, as torchtitan calls it (differentiable; waited on first use)."""
    from torch.distributed._functional_collectives import all_to_all_single

    return all_to_all_single(tensor, output_splits, input_splits, group)


class AllToAllDispatcher:
    """torchtitan 0.3.0's ``AllToAllTokenDispatcher`` (``models/common/token_dispatcher.py``) written out: the same
    steps in the same order, without its spmd-types and DeepEP branches."""

    def __init__(self, num_experts: int, top_k: int, ep_mesh):
        self.num_experts, self.top_k, self.group = num_experts, top_k, ep_mesh
        self.ep_size = ep_mesh.size()

    def dispatch(self, x, scores, expert_ids, counts):
        # _local_reorder: the (token, expert) pairs sorted by expert
        order = torch.argsort(expert_ids.view(-1), stable=True)
        sorted_scores = scores.view(-1)[order]
        token_of = order // self.top_k
        rows = x[token_of]
        with torch.no_grad():  # _token_count_exchange and _sync_token_count_exchange
            received = _all_to_all(counts.view(self.ep_size, -1), None, None, self.group)
            received = torch.ops._c10d_functional.wait_tensor(received).reshape(-1)
            input_splits = counts.view(self.ep_size, -1).sum(dim=1).tolist()
            output_splits = received.view(self.ep_size, -1).sum(dim=1).tolist()
        rows = _all_to_all(rows, output_splits, input_splits, self.group)  # _dispatch_token_exchange
        # _permute: rank-major (e0 r0, e1 r0, ..., e0 r1, ...) to expert-major (e0 r0, e0 r1, ...)
        local = received.shape[0] // self.ep_size
        matrix = received.view(self.ep_size, local)
        starts = (received.cumsum(0) - received).view(self.ep_size, local)
        lengths = matrix.t().reshape(-1)
        starts = starts.t().reshape(-1)
        segment = torch.arange(lengths.shape[0]).repeat_interleave(lengths, output_size=rows.shape[0])
        out_starts = lengths.cumsum(0) - lengths
        permuted = starts[segment] + torch.arange(segment.shape[0]) - out_starts[segment]
        meta = (token_of, sorted_scores, rows.shape, permuted, input_splits, output_splits)
        return rows[permuted, :], matrix.sum(0), meta

    def combine(self, rows, meta, x):
        token_of, sorted_scores, shape, permuted, input_splits, output_splits = meta
        unpermuted = rows.new_empty(shape)  # _unpermute
        unpermuted[permuted, :] = rows
        rows = _all_to_all(unpermuted, input_splits, output_splits, self.group)  # _combine_token_exchange
        rows = (rows.to(torch.float32) * sorted_scores.reshape(-1, 1)).to(rows.dtype)
        index = token_of.reshape(-1, 1).expand(-1, x.shape[-1])
        return torch.zeros_like(x).scatter_add(0, index, rows)


def torchtitan_dispatcher(num_experts: int, top_k: int, ep_mesh):
    """torchtitan's own ``AllToAllTokenDispatcher`` over ``ep_mesh`` (raises ImportError without torchtitan)."""
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("dtensor")  # torch's functional collectives (its default, spmd_types, needs its trainer)
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=top_k))
    dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return dispatcher


class RoutedExperts(torch.nn.Module):
    """In place of ``MixtralExperts``: this ep rank's rows of ``gate_up_proj`` and ``down_proj`` (plain
    parameters, outside FSDP, as torchtitan keeps experts apart from the dense FSDP units), tokens dispatched and
    combined by ``dispatcher``, the experts' grouped matmuls between."""

    def __init__(self, experts: torch.nn.Module, ep_rank: int, ep_size: int, dispatcher, top_k: int,
                 grouped_mm: str = "torch"):
        super().__init__()
        self.grouped_mm = grouped_mm  # "torch": torch._grouped_mm (torchtitan's); "fallback": transformers' loop
        total = experts.gate_up_proj.shape[0]
        per = total // ep_size
        rows = slice(ep_rank * per, (ep_rank + 1) * per)
        self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[rows].clone())
        self.down_proj = torch.nn.Parameter(experts.down_proj.detach()[rows].clone())
        self.num_experts, self.top_k, self.dispatcher = total, top_k, dispatcher

    def forward(self, hidden_states, top_k_index, top_k_weights):
        counts = torch.bincount(top_k_index.view(-1), minlength=self.num_experts)
        rows, local_counts, meta = self.dispatcher.dispatch(hidden_states, top_k_weights, top_k_index, counts)
        offsets = torch.cumsum(local_counts, dim=0, dtype=torch.int32)
        if self.grouped_mm == "torch":
            matmul = lambda x, w: torch._grouped_mm(x, w, offs=offsets)  # noqa: E731
        else:
            matmul = lambda x, w: torch.ops.transformers.grouped_mm_fallback(x, w, offsets)  # noqa: E731
        gate, up = matmul(rows, self.gate_up_proj.transpose(-2, -1)).chunk(2, dim=-1)
        out = matmul(F.silu(gate) * up, self.down_proj.transpose(-2, -1))
        return self.dispatcher.combine(out, meta, hidden_states)
