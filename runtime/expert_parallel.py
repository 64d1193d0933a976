"""Expert parallelism: the routed experts of a mixture-of-experts stage spread over ``--ep`` ranks, and the
all-to-all that moves each (token, expert) pair to the rank that holds the expert.

``tracepp split --ep E`` finds each block of routed experts in the traced graph (grouped matmuls that share the
per-expert token offsets, ``split/expert_parallel.py``) and rewrites it with two ops, so the rank script reads:

* ``torch.ops.tracepp.ep_dispatch(rows, offsets, num_experts)`` -> ``(local_rows, local_offsets, plan)``:
  ``rows`` are this rank's (token, expert) pairs sorted by expert and ``offsets`` the cumulative count per
  expert (what the model computed for its grouped matmuls). The per-expert counts go first (one all-to-all of
  ``ep x experts/ep`` integers), then the rows (one all-to-all with those splits), and the rows received are
  regrouped by local expert: ``local_rows`` and ``local_offsets`` feed the same grouped matmuls with this
  rank's experts only. ``plan`` holds the counts sent and received, for the way back. Backward: the gradient
  of ``local_rows`` goes back the same way (:func:`_exchange` reversed).
* ``torch.ops.tracepp.ep_expert_ids(local_offsets, local_rows)``: the local expert of each received row (0 ..
  experts/ep - 1), so a per-expert parameter gathered per row (an expert bias) is read on the expert's rank;
* ``torch.ops.tracepp.ep_combine(local_rows, plan)``: the experts' outputs sent back to the ranks their tokens
  came from, in their original order; backward dispatches the gradient again.

Dropless: every pair is sent, no capacity factor, so training is exact. The expert-parallel group is taken
from the data-parallel ranks (``ep`` divides ``dp``): each data-parallel rank keeps its own tokens and holds
``experts / ep`` of them; expert gradients are reduced only over the ranks that hold the same experts
(:func:`reduce_expert_grads`). The group is set once by the runtime (:func:`set_group`); with none (ep 1) the
ops are local (they still count the tokens per expert for the metrics). Imports torch only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from .process_state import shared

_NAMESPACE = "tracepp"
_STATE = shared("expert_parallel", {"group": None, "size": 1, "rank": 0})  # one per process (process_state)
_STATS: dict = shared("expert_load", {})  # block -> [tokens per expert summed over the step's microbatches, dropped]


def set_group(group, size: int, rank: int) -> None:
    """The process group of this rank's expert-parallel peers (``ep`` ranks of the data-parallel dim)."""
    _STATE.update(group=group, size=size, rank=rank)


def _counts(offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert counts from cumulative offsets (int64, on the CPU: the splits are Python ints)."""
    ends = offsets.detach().to("cpu", torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def _record(block: str, counts: torch.Tensor, rows: int) -> None:
    entry = _STATS.setdefault(block, [torch.zeros_like(counts), 0])
    entry[0] += counts
    entry[1] += rows - int(counts.sum())  # pairs past the last offset: routed to no expert (dropped)


def take_stats() -> dict:
    """{block: (tokens per expert over this rank's microbatches since the last call, dropped pairs)}; resets."""
    out = {block: (counts.clone(), dropped) for block, (counts, dropped) in _STATS.items()}
    _STATS.clear()
    return out


def _order(received: torch.Tensor) -> torch.Tensor:
    """The permutation taking rows received source-major (source s: its rows for local expert 0, 1, ...) to
    expert-major (expert 0: from source 0, 1, ...): ``expert_major = source_major[order]``."""
    sources, experts = received.shape
    flat = received.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(sources, experts).t().reshape(-1)  # (expert, source) blocks
    lengths = received.t().reshape(-1)
    total = int(lengths.sum())
    block_starts = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total) - torch.repeat_interleave(block_starts, lengths)
    return torch.repeat_interleave(starts, lengths) + within


def _exchange(rows: torch.Tensor, send: list, receive: list) -> torch.Tensor:
    out = rows.new_empty((sum(receive),) + tuple(rows.shape[1:]))
    if _STATE["size"] == 1:
        out.copy_(rows)
        return out
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=_STATE["group"])
    return out


def _dispatch_rows(rows: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """This rank's sorted rows to the experts' ranks, regrouped by local expert."""
    sent, received = plan[0], plan[1]
    moved = _exchange(rows, sent.sum(1).tolist(), received.sum(1).tolist())
    return moved[_order(received).to(moved.device)]


def _combine_rows(rows: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
    """The experts' rows back to the ranks their tokens came from, in each rank's sorted order."""
    sent, received = plan[0], plan[1]
    source_major = torch.empty_like(rows)
    source_major[_order(received).to(rows.device)] = rows
    return _exchange(source_major, received.sum(1).tolist(), sent.sum(1).tolist())


def _dispatch(rows: torch.Tensor, offsets: torch.Tensor, num_experts: int, block: str):
    size = _STATE["size"]
    counts = _counts(offsets)
    _record(block, counts, rows.shape[0])
    if counts.numel() != num_experts or num_experts % size:
        raise RuntimeError(f"expert parallelism: {counts.numel()} expert offsets for {num_experts} experts over "
                           f"--ep {size}")
    sent = counts.reshape(size, num_experts // size)
    received = torch.empty_like(sent)
    if size > 1:
        dist.all_to_all_single(received, sent.contiguous(), group=_STATE["group"])  # the counts first
    else:
        received.copy_(sent)
    plan = torch.stack([sent, received])
    local_offsets = torch.cumsum(received.sum(0), 0).to(device=offsets.device, dtype=offsets.dtype)
    # rows past the last offset belong to no expert: they stay here (the model drops them itself)
    kept = rows[:int(counts.sum())]
    return _dispatch_rows(kept, plan), local_offsets, plan


def _combine(rows: torch.Tensor, plan: torch.Tensor, total: int) -> torch.Tensor:
    back = _combine_rows(rows, plan)
    if back.shape[0] == total:
        return back
    out = back.new_zeros((total,) + tuple(back.shape[1:]))  # dropped pairs: zero, as a grouped matmul leaves them
    out[:back.shape[0]] = back
    return out


def native_grouped_mm(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs ``torch._grouped_mm`` here (as eager transformers does): on CPU (its kernel
    takes every dtype from torch 2.11 on) and for bf16 on CUDA, not inside ``torch.compile`` (inductor takes
    grouped matmuls in bf16 only)."""
    if torch.compiler.is_compiling() and weight.dtype != torch.bfloat16:
        return False
    if is_fake(weight) or weight.device.type == "meta":  # torch's shape function takes bf16 only
        return False
    if weight.device.type == "cpu":
        return hasattr(torch, "_grouped_mm")
    return weight.device.type == "cuda" and weight.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _loop_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One ``mm`` per group, rows past the last offset zero (transformers' ``grouped_mm_fallback``, as plain ops)."""
    ends = offs.tolist()
    pieces, start = [], 0
    for group, end in enumerate(ends):
        pieces.append(input[start:end] @ weight[group])
        start = end
    if start < input.shape[0]:
        pieces.append(input.new_zeros((input.shape[0] - start, weight.shape[-1])))
    return torch.cat(pieces)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch.ops.tracepp.grouped_mm``: what a traced Hugging Face MoE's ``transformers.grouped_mm_fallback``
    becomes in the rank scripts (``split/expert_parallel.py``). transformers falls back to its per-expert loop
    whenever it is traced in fp32 (``torch.export`` counts as compiling), so a traced Mixtral ran the loop where the
    same model in eager runs ``torch._grouped_mm``; this op makes eager's choice at run time
    (:func:`native_grouped_mm`): the kernel where it runs, else transformers' own loop (or the same loop in plain
    ops where transformers is not loaded; and on fake tensors, whose shape function for the kernel takes bf16 only).
    Rows past the last offset are zero either way, and get no gradient. On CPU, for the benchmark Mixtral's shapes
    (512 rows, 4 experts of 128 x 512), the kernel took 1.9 - 2.3 ms per forward and backward against the loop's
    2.5 - 2.9 (1 thread, 3 alternations of 50)."""
    if native_grouped_mm(input, weight):
        # the kernel leaves rows past the last offset (and their input gradient) unwritten: only routed rows go in
        # (one read of the last offset, as the loop reads them all)
        routed = int(offs[-1]) if offs.numel() else 0
        if routed == input.shape[0]:
            return torch._grouped_mm(input, weight, offs=offs)
        out = torch._grouped_mm(input[:routed], weight, offs=offs)
        return torch.cat([out, out.new_zeros((input.shape[0] - routed, out.shape[1]))])
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        return fallback.default(input, weight, offs)
    return _loop_grouped_mm(input, weight, offs)


def _register():
    if hasattr(getattr(torch.ops, _NAMESPACE), "ep_dispatch"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register.lib = lib
    lib.define("ep_dispatch(Tensor rows, Tensor offsets, int num_experts, str block) -> (Tensor, Tensor, Tensor)")
    lib.define("ep_combine(Tensor rows, Tensor plan, int total) -> Tensor")
    lib.define("moe_tokens(Tensor offsets, int rows, str block) -> Tensor")
    lib.define("grouped_mm(Tensor input, Tensor weight, Tensor offs) -> Tensor")
    lib.impl("grouped_mm", grouped_mm, "CompositeImplicitAutograd")

    def tokens(offsets, rows, block):  # without --ep: the same counts, for the metrics; the offsets unchanged
        _record(block, _counts(offsets), rows)
        return offsets.clone()

    for device in ("CPU", "CUDA"):
        lib.impl("ep_dispatch", _dispatch, device)
        lib.impl("ep_combine", _combine, device)
        lib.impl("moe_tokens", tokens, device)
    torch.library.register_fake(f"{_NAMESPACE}::moe_tokens", lambda offsets, rows, block: torch.empty_like(offsets),
                                lib=lib)

    def dispatch_fake(rows, offsets, num_experts, block):
        # planning a stage's memory (tracepp.codegen.memory): a rank takes in the rows it sends times the planned
        # imbalance of the routing (1: balanced), at most all ep ranks' rows; otherwise how many rows arrive
        # depends on the data
        factor = _STATE.get("planning")
        count = (min(-(-rows.shape[0] * int(factor * 1000) // 1000), rows.shape[0] * _STATE["size"]) if factor
                 else torch.library.get_ctx().new_dynamic_size())
        size = _STATE["size"]
        return (rows.new_empty((count,) + tuple(rows.shape[1:])), offsets.new_empty(num_experts // size),
                torch.empty((2, size, num_experts // size), dtype=torch.int64))

    def combine_fake(rows, plan, total):
        return rows.new_empty((total,) + tuple(rows.shape[1:]))

    torch.library.register_fake(f"{_NAMESPACE}::ep_dispatch", dispatch_fake, lib=lib)
    torch.library.register_fake(f"{_NAMESPACE}::ep_combine", combine_fake, lib=lib)

    def dispatch_setup(ctx, inputs, output):
        ctx.total = inputs[0].shape[0]
        ctx.save_for_backward(output[2])

    def dispatch_backward(ctx, grad_rows, _grad_offsets, _grad_plan):
        plan, = ctx.saved_tensors
        return torch.ops.tracepp.ep_combine.default(grad_rows, plan, ctx.total), None, None, None

    def combine_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.kept = inputs[0].shape[0] if _STATE.get("planning") else int(inputs[1][0].sum())
        ctx.received = inputs[0].shape[0]

    def combine_backward(ctx, grad):
        plan, = ctx.saved_tensors
        if _STATE.get("planning"):  # on fake tensors: the rows go back to the experts, regrouped
            moved = grad.new_empty((ctx.received,) + tuple(grad.shape[1:]))
            return moved.clone(), None, None
        return _dispatch_rows(grad[:ctx.kept], plan), None, None

    torch.library.register_autograd(f"{_NAMESPACE}::ep_dispatch", dispatch_backward, setup_context=dispatch_setup,
                                    lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::ep_combine", combine_backward, setup_context=combine_setup,
                                    lib=lib)


_register()


def _expert_ids(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The local expert index of each of ``rows`` (grouped by local expert, ``offsets`` cumulative)."""
    counts = _counts(offsets).to(offsets.device)
    ids = torch.repeat_interleave(torch.arange(counts.numel(), device=offsets.device), counts)
    if ids.numel() != rows.shape[0]:
        raise RuntimeError(f"expert parallelism: {rows.shape[0]} rows for {ids.numel()} counted by the offsets")
    return ids


def _register_expert_ids():
    """``ep_expert_ids`` (a library fragment of its own: an older runtime copy may hold the other ops)."""
    if hasattr(getattr(torch.ops, _NAMESPACE), "ep_expert_ids"):
        return
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    _register_expert_ids.lib = lib
    lib.define("ep_expert_ids(Tensor offsets, Tensor rows) -> Tensor")
    for device in ("CPU", "CUDA"):
        lib.impl("ep_expert_ids", _expert_ids, device)
    torch.library.register_fake(f"{_NAMESPACE}::ep_expert_ids",
                                lambda offsets, rows: offsets.new_empty((rows.shape[0],), dtype=torch.int64), lib=lib)
    torch.library.register_autograd(f"{_NAMESPACE}::ep_expert_ids", lambda ctx, grad: (None, None),
                                    setup_context=lambda ctx, inputs, output: None, lib=lib)


_register_expert_ids()


# ---- this rank's experts

def placement_of(manifest: dict, fqn: str):
    """The expert-parallel shard dim of a parameter (0: the expert dim of a routed expert's weight), or None."""
    entry = (manifest.get("ep") or {}).get("params", {}).get(fqn)
    return None if entry is None else entry.get("dim", 0)


def piece_for(manifest: dict, size: int, rank: int):
    """``piece(fqn, tensor)``: a routed expert weight's experts of ep rank ``rank`` (storage of their own),
    anything else as it is."""
    experts = {fqn: entry["experts"] for fqn, entry in (manifest.get("ep") or {}).get("params", {}).items()}

    def piece(fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        dim = placement_of(manifest, fqn)
        if dim is None or tensor.shape[dim] != experts.get(fqn, tensor.shape[dim]):
            return tensor  # not an expert weight, or read as this rank's rows already (``rows_for``)
        return tensor.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)
    return piece


def rows_for(manifest: dict, size: int, rank: int):
    """``rows(fqn, shape) -> (dim, start, stop)`` of a routed expert weight's experts on ep rank ``rank`` (what a
    checkpoint reader slices, so a rank reads only its experts), None for any other tensor."""
    def rows(fqn: str, shape) -> tuple:
        dim = placement_of(manifest, fqn)
        if dim is None:
            return None
        each = shape[dim] // size
        return dim, rank * each, (rank + 1) * each
    return rows


def distribute(state: dict, manifest: dict, ep_mesh) -> dict:
    """Routed expert weights (already cut to this rank's experts) -> DTensors ``Shard(0)`` over the ``ep`` mesh,
    so checkpoints hold the whole expert dim and load into any ep size; anything else unchanged."""
    from torch.distributed.tensor import DTensor, Shard

    out = dict(state)
    for fqn, tensor in state.items():
        dim = placement_of(manifest, fqn)
        if dim is None or not isinstance(tensor, torch.nn.Parameter):
            continue
        value = DTensor.from_local(tensor.detach(), ep_mesh, [Shard(dim)], run_check=False)
        out[fqn] = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
    return out


def reduce_expert_grads(params: list, group, dp: int) -> None:
    """The gradient of this rank's experts: summed over the ranks that hold the same experts (the other ep
    groups of the data-parallel dim), divided by the data-parallel size as every other gradient is (each
    replica's loss is its own tokens' mean; their mean is the global batch's)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    if group is None:  # ep = dp: no other rank holds these experts; the division alone, in place (no flat copy)
        torch._foreach_div_(grads, float(dp))
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dp)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
