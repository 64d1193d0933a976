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

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

MODES = ("fsdp", "ddp", "hsdp")


@dataclass(frozen=True)
class Layout:
    """The parallel layout of a job, one value from the command line to the runtime: ``pp`` pipeline ranks;
    ``dp`` data-parallel replicas with their ``dp_mode`` (fsdp, ddp, hsdp), HSDP's ``dp_shard`` and the
    ``dp_order`` of the ranks; ``tp`` tensor-parallel ranks per stage, with ``sequence_parallel`` activations
    between its regions; ``ep`` expert-parallel ranks, carved out of the data-parallel ones (``ep`` divides
    ``dp``). The manifest records it as ``plan["mesh"]`` (:meth:`to_json`)."""

    pp: int = 1
    dp: int = 1
    dp_mode: str = "fsdp"
    dp_shard: Optional[int] = None
    dp_order: str = "pp-inner"
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """The manifest's ``plan["mesh"]`` (the keys older manifests used for dp: mode, shard, order)."""
        out = {"dp": self.dp, "pp": self.pp, "mode": self.dp_mode, "shard": self.dp_shard, "order": self.dp_order}
        if self.tp > 1:
            out["tp"] = self.tp
        if self.ep > 1:
            out["ep"] = self.ep
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        return out

    @classmethod
    def from_json(cls, mesh: Optional[dict], pp: int) -> "Layout":
        mesh = mesh or {}
        return cls(pp=pp, dp=mesh.get("dp", 1), dp_mode=mesh.get("mode", "fsdp"), dp_shard=mesh.get("shard"),
                   dp_order=mesh.get("order", "pp-inner"), tp=mesh.get("tp", 1), ep=mesh.get("ep", 1),
                   sequence_parallel=bool(mesh.get("sequence_parallel", False)))

    def check(self) -> None:
        """Refuse a layout before anything is traced: the error names the numbers and the fix."""
        for name, value in (("--ranks", self.pp), ("--dp", self.dp), ("--tp", self.tp), ("--ep", self.ep)):
            if value < 1:
                raise ValueError(f"{name} {value}: need at least 1")
        if self.dp_mode not in MODES:
            raise ValueError(f"--dp-mode {self.dp_mode!r} is not one of {', '.join(MODES)}")
        if self.dp_mode == "hsdp":
            if self.dp_shard is None or self.dp_shard < 1 or self.dp % self.dp_shard:
                raise ValueError(f"--dp-mode hsdp needs --dp-shard K with K dividing --dp {self.dp} "
                                 f"(K = {', '.join(str(k) for k in _divisors(self.dp))})")
        elif self.dp_shard is not None:
            raise ValueError(f"--dp-shard is for --dp-mode hsdp only (got --dp-mode {self.dp_mode})")
        if self.tp > 1 and self.dp_order != "pp-inner":
            raise ValueError(f"--tp {self.tp} keeps each stage's tp ranks consecutive (one node), inside pp and dp: "
                             f"use --dp-order pp-inner with --tp")
        if self.ep > 1 and self.dp_mode == "hsdp":
            raise ValueError(f"--ep {self.ep} takes its ranks from the data-parallel ranks, which --dp-mode hsdp "
                             f"already splits in two: use --dp-mode fsdp or ddp with --ep")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel splits the activations between tensor-parallel regions over the "
                             "tp ranks: use it with --tp T (T > 1)")
        if self.dp % self.ep:
            raise ValueError(f"--ep {self.ep} takes each stage's expert-parallel ranks from its --dp {self.dp} "
                             f"data-parallel ranks, so it must divide --dp: use --ep in "
                             f"{_divisors(self.dp)}, or --dp a multiple of {self.ep}")

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.dp:
            works = _divisors(batch_size)
            raise ValueError(f"--dp {self.dp} does not divide the global batch of {batch_size} samples: each "
                             f"replica takes an equal contiguous slice; use --dp in {works}, or a batch that "
                             f"{self.dp} divides")


def _divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def mesh_layout(plan: dict) -> Layout:
    """The plan's layout (one replica, no tp, when it records none)."""
    return Layout.from_json(plan.get("mesh"), plan["num_ranks"])


def world_size(layout: Layout) -> int:
    return layout.world_size


def global_rank(layout: Layout, dp_index: int, pp_rank: int, tp_index: int = 0) -> int:
    """Tensor parallelism is innermost: the tp ranks of one (dp, pp) place are consecutive (one node)."""
    if layout.dp_order == "dp-inner":
        base = pp_rank * layout.dp + dp_index
    else:
        base = dp_index * layout.pp + pp_rank
    return base * layout.tp + tp_index


def coordinates(layout: Layout, rank: int) -> tuple:
    """(dp_index, pp_rank) of a global rank (its tp index is :func:`tp_index`)."""
    rank //= layout.tp
    if layout.dp_order == "dp-inner":
        return rank % layout.dp, rank // layout.dp
    return rank // layout.pp, rank % layout.pp


def tp_index(layout: Layout, rank: int) -> int:
    return rank % layout.tp


def ep_index(layout: Layout, dp_index: int) -> int:
    """This replica's place in its expert-parallel group (consecutive dp indices share their experts)."""
    return dp_index % layout.ep


def replicas_text(layout: Layout) -> list:
    """One line per pipeline rank: the global ranks that are its replicas."""
    return [f"pipeline rank {pp}: global ranks {', '.join(str(global_rank(layout, d, pp)) for d in range(layout.dp))}"
            for pp in range(layout.pp)]


def describe(plan: dict) -> list:
    """What ``tracepp inspect`` and the rank-script headers show about the mesh (nothing without --dp/--tp)."""
    layout = mesh_layout(plan)
    dp, pp, tp = layout.dp, layout.pp, layout.tp
    holders = (f"each expert's gradient reduced over the {dp // layout.ep} ranks holding it" if dp > layout.ep
               else "each expert on one rank of the group")
    expert = (f"; experts over ep={layout.ep} of the dp ranks (consecutive dp indices, all-to-all of the "
              f"routed tokens), {holders}" if layout.ep > 1 else "")
    if tp > 1:
        return [f"Mesh (dp={dp}, pp={pp}, tp={tp}): {dp * pp * tp} processes; tensor parallel inside each "
                f"stage over {tp} consecutive ranks (global rank = (dp_index * pp + pp_rank) * tp + tp_index)"
                + (f"; {layout.dp_mode} over dp" if dp > 1 else "") + expert]
    if dp == 1:
        return []
    how = {"fsdp": "fully_shard of each stage over dp", "ddp": "replicate (DDP) of each stage over dp",
           "hsdp": f"fully_shard over dp_shard ({layout.dp_shard} ranks), replicated over dp_replicate "
                   f"({dp // (layout.dp_shard or 1)})"}[layout.dp_mode]
    formula = "pp_rank * dp + dp_index" if layout.dp_order == "dp-inner" else "dp_index * pp + pp_rank"
    return [f"Mesh (dp={dp}, pp={pp}): {dp * pp} processes; {layout.dp_mode}: {how}; order {layout.dp_order} "
            f"(global rank = {formula}){expert}"] + replicas_text(layout)


def parameter_placements(layout: Layout, shapes: dict, tp_plan: dict, ep_plan: dict) -> dict:
    """{fqn: {"dp": how the data-parallel ranks hold it, "ep": its expert-parallel shard dim or None, "tp": its
    tensor-parallel shard dim or None, "per_rank": the shape one rank holds}} for every parameter (``shapes``:
    its whole shape). FSDP shards dim 0 of what tp and ep leave over dp (the last rank's piece may be shorter);
    routed experts stay outside FSDP, whole on each of the dp / ep ranks that hold them."""
    out = {}
    tp_params, ep_params = tp_plan.get("params", {}), ep_plan.get("params", {}) if layout.ep > 1 else {}
    for fqn, shape in shapes.items():
        local = list(shape)
        tp_dim = (tp_params.get(fqn) or {}).get("dim") if layout.tp > 1 else None
        ep_dim = (ep_params.get(fqn) or {}).get("dim")
        if tp_dim is not None:
            local[tp_dim] //= layout.tp
        if ep_dim is not None:
            local[ep_dim] //= layout.ep
        if layout.dp == 1:
            dp = None
        elif ep_dim is not None:
            dp = f"replicate over {layout.dp // layout.ep}" if layout.dp > layout.ep else "one copy"
        elif layout.dp_mode == "ddp":
            dp = f"replicate over {layout.dp}"
        else:
            over = layout.dp if layout.dp_mode == "fsdp" else layout.dp_shard
            dp = f"shard(0) over {over}"
            if local:
                local[0] = -(-local[0] // over)
        out[fqn] = {"dp": dp, "ep": ep_dim, "tp": tp_dim, "per_rank": local}
    return out


def build_mesh(layout: Layout, device: torch.device):
    """(the job's DeviceMesh, dims ("dp", "pp") (HSDP: ("dp_replicate", "dp_shard", "pp"); expert parallel:
    ("edp", "ep", "pp"), the ep ranks of a replica group consecutive), with a last dim "tp" under tensor
    parallelism; the 1-D mesh of this rank's replicas, for the loss and anything else averaged over dp); call
    it on every rank. The ranks are :func:`global_rank`'s."""
    from torch.distributed.device_mesh import DeviceMesh

    dp, pp, tp = layout.dp, layout.pp, layout.tp
    ranks = torch.arange(dp * pp)
    grid = ranks.reshape(pp, dp).T if layout.dp_order == "dp-inner" else ranks.reshape(dp, pp)
    names = ("dp", "pp")
    if tp > 1:  # tp innermost: the tp ranks of one (dp, pp) place are consecutive
        grid = grid.unsqueeze(-1) * tp + torch.arange(tp)
        names += ("tp",)
    if layout.dp_mode == "hsdp":
        shard = layout.dp_shard
        grid = grid.reshape(dp // shard, shard, *grid.shape[1:])
        mesh = DeviceMesh(device.type, grid, mesh_dim_names=("dp_replicate", "dp_shard") + names[1:])
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if layout.ep > 1:  # expert parallel: consecutive dp indices share their experts (dp_index = edp * ep + ep)
        grid = grid.reshape(dp // layout.ep, layout.ep, *grid.shape[1:])
        mesh = DeviceMesh(device.type, grid, mesh_dim_names=("edp", "ep") + names[1:])
        return mesh, mesh["edp", "ep"]._flatten("dp")
    mesh = DeviceMesh(device.type, grid, mesh_dim_names=names)
    return mesh, mesh["dp"]


def dp_mesh(mesh, layout: Layout):
    """The sub-mesh data parallelism runs over: 1-D "dp", or HSDP's 2-D (replicate, shard)."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_mode == "hsdp" else mesh["dp"]


def wrap_stage(stage, mesh, layout: Layout, ignored=None):
    """Wrap one StageModule over the dp dim with torch's own engine; returns the same module. ``ignored``: the
    parameters it leaves alone (routed experts, already divided over ep: their gradients are reduced over the
    ranks holding the same experts, ``expert_parallel.reduce_expert_grads``)."""
    sub = dp_mesh(mesh, layout)
    ignored = set(ignored or ()) or None
    if layout.dp_mode == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(stage, mesh=sub, ignored_params=ignored)
    else:
        from torch.distributed.fsdp import fully_shard
        # The stage function reads its parameters directly, not through the blocks' forward, so the stage is
        # the one FSDP unit (a block's own hooks would never run).
        fully_shard(stage, mesh=sub, reshard_after_forward=False, ignored_params=ignored)
    return stage


def reduce_after_split_backward(stage) -> None:
    """After a step of a schedule that splits the backward (I, then W): reduce the gradients every W has
    accumulated, as FSDP's own post-backward would have after a whole backward (the way torch's pipelining
    does it for FSDP2: the param groups' post_backward, then the root's final callback). Each backward of the
    step ran with gradient sync off (:func:`set_last_backward` False)."""
    stage.set_is_last_backward(True)
    stage.set_reshard_after_backward(True)
    stage.set_requires_gradient_sync(True)
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
    from torch.distributed.fsdp import fully_shard

    engine = replicate if isinstance(stage, ReplicateModule) else fully_shard
    state = engine.state(stage)
    for member in state._state_ctx.all_states:
        groups = getattr(member, "_fsdp_param_groups", None)
        if groups is None:  # torch before the plural list
            groups = [member._fsdp_param_group] if member._fsdp_param_group is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def set_last_backward(stage, is_last: bool) -> None:
    """Before a backward of a wrapped stage: reduce gradients and reshard only in the step's last one."""
    stage.set_is_last_backward(is_last)
    stage.set_requires_gradient_sync(is_last)
    stage.set_reshard_after_backward(is_last)


def replication_factor(layout: Layout) -> int:
    """How many dp ranks hold the same gradient shard (their local norms must be counted once)."""
    if layout.dp_mode == "ddp":
        return layout.dp
    if layout.dp_mode == "hsdp":
        return layout.dp // layout.dp_shard
    return 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
