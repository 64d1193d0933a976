"""Data parallel x pipeline parallel: the job's ``DeviceMesh`` and the wrapping of this rank's stages.

The manifest's ``plan["mesh"]`` says ``{"dp": N, "pp": R, "mode": "fsdp"|"ddp"|"hsdp", "shard": K, "order":
"pp-inner"|"dp-inner"}``. The job runs ``R * N`` processes. With ``pp-inner`` (the default) consecutive global
ranks form one pipeline: global rank = dp_index * R + pp_rank, so a pipeline's point-to-point traffic stays on
one node when R divides the GPUs per node; ``dp-inner`` puts the replicas of one pipeline rank next to each
other instead (global rank = pp_rank * N + dp_index). The mesh has dims ``("dp", "pp")``; with HSDP the dp
dim is itself 2-D, ``("dp_replicate", "dp_shard")``, sharding over K ranks and replicating over N / K.

Each stage is wrapped with torch's own engine over the dp dim: ``fully_shard`` (FSDP2) for ``fsdp``/``hsdp``,
``replicate`` (DDP semantics, on FSDP2's machinery, so gradient sync can be deferred the same way) for ``ddp``.
Parameters stay unsharded from a stage's first forward to its last backward of the step
(``reshard_after_forward=False``), and gradients are reduced once per step, in the stage's last backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

MODES = ("fsdp", "ddp", "hsdp")


def mesh_layout(plan: dict) -> dict:
    """The plan's data-parallel layout, or one replica (dp 1) when it has none."""
    mesh = plan.get("mesh") or {}
    return {"dp": mesh.get("dp", 1), "pp": plan["num_ranks"], "mode": mesh.get("mode", "fsdp"),
            "shard": mesh.get("shard"), "order": mesh.get("order", "pp-inner"), "tp": mesh.get("tp", 1)}


def world_size(layout: dict) -> int:
    return layout["dp"] * layout["pp"] * layout.get("tp", 1)


def global_rank(layout: dict, dp_index: int, pp_rank: int, tp_index: int = 0) -> int:
    """Tensor parallelism is innermost: the tp ranks of one (dp, pp) place are consecutive (one node)."""
    if layout["order"] == "dp-inner":
        base = pp_rank * layout["dp"] + dp_index
    else:
        base = dp_index * layout["pp"] + pp_rank
    return base * layout.get("tp", 1) + tp_index


def coordinates(layout: dict, rank: int) -> tuple:
    """(dp_index, pp_rank) of a global rank (its tp index is :func:`tp_index`)."""
    rank //= layout.get("tp", 1)
    if layout["order"] == "dp-inner":
        return rank % layout["dp"], rank // layout["dp"]
    return rank // layout["pp"], rank % layout["pp"]


def tp_index(layout: dict, rank: int) -> int:
    return rank % layout.get("tp", 1)


def replicas_text(layout: dict) -> list:
    """One line per pipeline rank: the global ranks that are its replicas."""
    return [f"pipeline rank {pp}: global ranks {', '.join(str(global_rank(layout, d, pp)) for d in range(layout['dp']))}"
            for pp in range(layout["pp"])]


def describe(plan: dict) -> list:
    """What ``tracepp inspect`` and the rank-script headers show about the mesh (nothing without --dp/--tp)."""
    layout = mesh_layout(plan)
    dp, pp, tp = layout["dp"], layout["pp"], layout["tp"]
    if tp > 1:
        return [f"Mesh (dp={dp}, pp={pp}, tp={tp}): {dp * pp * tp} processes; tensor parallel inside each "
                f"stage over {tp} consecutive ranks (global rank = (dp_index * pp + pp_rank) * tp + tp_index)"
                + (f"; {layout['mode']} over dp" if dp > 1 else "")]
    if dp == 1:
        return []
    how = {"fsdp": "fully_shard of each stage over dp", "ddp": "replicate (DDP) of each stage over dp",
           "hsdp": f"fully_shard over dp_shard ({layout['shard']} ranks), replicated over dp_replicate "
                   f"({dp // (layout['shard'] or 1)})"}[layout["mode"]]
    formula = "pp_rank * dp + dp_index" if layout["order"] == "dp-inner" else "dp_index * pp + pp_rank"
    return [f"Mesh (dp={dp}, pp={pp}): {dp * pp} processes; {layout['mode']}: {how}; order {layout['order']} "
            f"(global rank = {formula})"] + replicas_text(layout)


def check_layout(dp: int, mode: str, shard, batch_size: int) -> None:
    """Refuse a layout before anything is traced: the error names the numbers and the fix."""
    if dp < 1:
        raise ValueError(f"--dp {dp}: need at least 1 replica")
    if mode not in MODES:
        raise ValueError(f"--dp-mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "hsdp":
        if shard is None or shard < 1 or dp % shard:
            raise ValueError(f"--dp-mode hsdp needs --dp-shard K with K dividing --dp {dp} "
                             f"(K = {', '.join(str(k) for k in range(1, dp + 1) if dp % k == 0)})")
    elif shard is not None:
        raise ValueError(f"--dp-shard is for --dp-mode hsdp only (got --dp-mode {mode})")
    if batch_size % dp:
        works = [n for n in range(1, batch_size + 1) if batch_size % n == 0]
        raise ValueError(f"--dp {dp} does not divide the global batch of {batch_size} samples: each replica "
                         f"takes an equal contiguous slice; use --dp in {works}, or a batch that {dp} divides")


def build_mesh(layout: dict, device: torch.device):
    """(the job's DeviceMesh, dims ("dp", "pp") (HSDP: ("dp_replicate", "dp_shard", "pp")), with a last dim "tp"
    under tensor parallelism; the 1-D mesh of this rank's replicas, for the loss and anything else averaged
    over dp); call it on every rank. The ranks are :func:`global_rank`'s."""
    from torch.distributed.device_mesh import DeviceMesh

    dp, pp, tp = layout["dp"], layout["pp"], layout.get("tp", 1)
    ranks = torch.arange(dp * pp)
    grid = ranks.reshape(pp, dp).T if layout["order"] == "dp-inner" else ranks.reshape(dp, pp)
    names = ("dp", "pp")
    if tp > 1:  # tp innermost: the tp ranks of one (dp, pp) place are consecutive
        grid = grid.unsqueeze(-1) * tp + torch.arange(tp)
        names += ("tp",)
    if layout["mode"] == "hsdp":
        shard = layout["shard"]
        grid = grid.reshape(dp // shard, shard, *grid.shape[1:])
        mesh = DeviceMesh(device.type, grid, mesh_dim_names=("dp_replicate", "dp_shard") + names[1:])
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=names)
    return mesh, mesh["dp"]


def dp_mesh(mesh, layout: dict):
    """The sub-mesh data parallelism runs over: 1-D "dp", or HSDP's 2-D (replicate, shard)."""
    return mesh["dp_replicate", "dp_shard"] if layout["mode"] == "hsdp" else mesh["dp"]


def wrap_stage(stage, mesh, layout: dict):
    """Wrap one StageModule over the dp dim with torch's own engine; returns the same module."""
    sub = dp_mesh(mesh, layout)
    if layout["mode"] == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(stage, mesh=sub)
    else:
        from torch.distributed.fsdp import fully_shard
        # The stage function reads its parameters directly, not through the blocks' forward, so the stage is
        # the one FSDP unit (a block's own hooks would never run).
        fully_shard(stage, mesh=sub, reshard_after_forward=False)
    return stage


def set_last_backward(stage, is_last: bool) -> None:
    """Before a backward of a wrapped stage: reduce gradients and reshard only in the step's last one."""
    stage.set_is_last_backward(is_last)
    stage.set_requires_gradient_sync(is_last)
    stage.set_reshard_after_backward(is_last)


def replication_factor(layout: dict) -> int:
    """How many dp ranks hold the same gradient shard (their local norms must be counted once)."""
    if layout["mode"] == "ddp":
        return layout["dp"]
    if layout["mode"] == "hsdp":
        return layout["dp"] // layout["shard"]
    return 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
