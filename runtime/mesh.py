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
    ``dp``, or ``dp x cp`` with context parallelism); ``cp`` context-parallel ranks per stage, each holding 1/cp
    of every sample's sequence (docs/context-parallel.md). The manifest records it as ``plan["mesh"]``
    (:meth:`to_json`)."""

    pp: int = 1
    dp: int = 1
    dp_mode: str = "fsdp"
    dp_shard: Optional[int] = None
    dp_order: str = "pp-inner"
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)

    def data_parallel(self) -> "Layout":
        """The layout as FSDP/DDP see it: with context parallelism every cp rank holds the same parameters, and
        their gradients are reduced over dp x cp, one data-parallel dim of dp * cp ranks (HSDP shards over
        dp_shard x cp)."""
        if self.cp == 1:
            return self
        return self.replace(dp=self.dp * self.cp, cp=1,
                            dp_shard=self.dp_shard * self.cp if self.dp_shard else None)

    def to_json(self) -> dict:
        """The manifest's ``plan["mesh"]`` (the keys older manifests used for dp: mode, shard, order)."""
        out = {"dp": self.dp, "pp": self.pp, "mode": self.dp_mode, "shard": self.dp_shard, "order": self.dp_order}
        if self.tp > 1:
            out["tp"] = self.tp
        if self.ep > 1:
            out["ep"] = self.ep
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        if self.cp > 1:
            out["cp"] = self.cp
        return out

    @classmethod
    def from_json(cls, mesh: Optional[dict], pp: int) -> "Layout":
        mesh = mesh or {}
        return cls(pp=pp, dp=mesh.get("dp", 1), dp_mode=mesh.get("mode", "fsdp"), dp_shard=mesh.get("shard"),
                   dp_order=mesh.get("order", "pp-inner"), tp=mesh.get("tp", 1), ep=mesh.get("ep", 1),
                   sequence_parallel=bool(mesh.get("sequence_parallel", False)), cp=mesh.get("cp", 1))

    def check(self) -> None:
        """Refuse a layout before anything is traced: the error names the numbers and the fix."""
        for name, value in (("--ranks", self.pp), ("--dp", self.dp), ("--tp", self.tp), ("--ep", self.ep),
                            ("--cp", self.cp)):
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
        if self.cp > 1 and self.dp * self.cp % self.ep:
            raise ValueError(f"--ep {self.ep} takes each stage's expert-parallel ranks from its --dp {self.dp} x --cp "
                             f"{self.cp} ranks, so it must divide {self.dp * self.cp}: use --ep in "
                             f"{_divisors(self.dp * self.cp)}")
        if self.cp == 1 and self.dp % self.ep:
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


def global_rank(layout: Layout, dp_index: int, pp_rank: int, tp_index: int = 0, cp_index: int = 0) -> int:
    """Tensor parallelism is innermost, context parallelism next: the cp x tp ranks of one (dp, pp) place are
    consecutive (one node), global rank = (base * cp + cp_index) * tp + tp_index."""
    if layout.dp_order == "dp-inner":
        base = pp_rank * layout.dp + dp_index
    else:
        base = dp_index * layout.pp + pp_rank
    return (base * layout.cp + cp_index) * layout.tp + tp_index


def coordinates(layout: Layout, rank: int) -> tuple:
    """(dp_index, pp_rank) of a global rank (its tp index is :func:`tp_index`, its cp index :func:`cp_index`)."""
    rank //= layout.tp * layout.cp
    if layout.dp_order == "dp-inner":
        return rank % layout.dp, rank // layout.dp
    return rank // layout.pp, rank % layout.pp


def tp_index(layout: Layout, rank: int) -> int:
    return rank % layout.tp


def cp_index(layout: Layout, rank: int) -> int:
    return rank // layout.tp % layout.cp


def ep_index(layout: Layout, dp_index: int, cp_index: int = 0) -> int:
    """This replica's place in its expert-parallel group (consecutive dp indices share their experts; with
    context parallelism, consecutive indices of the flattened dp x cp dim, dp_index * cp + cp_index)."""
    return (dp_index * layout.cp + cp_index) % layout.ep


def replicas_text(layout: Layout) -> list:
    """One line per pipeline rank: the global ranks that are its replicas."""
    return [f"pipeline rank {pp}: global ranks {', '.join(str(global_rank(layout, d, pp)) for d in range(layout.dp))}"
            for pp in range(layout.pp)]


def _describe_cp(layout: Layout) -> list:
    """``describe``'s lines with context parallelism."""
    dp, pp, cp, tp = layout.dp, layout.pp, layout.cp, layout.tp
    how = {"fsdp": f"fully_shard of each stage over dp x cp ({dp * cp} ranks)",
           "ddp": f"replicate (DDP) of each stage over dp x cp ({dp * cp} ranks)",
           "hsdp": f"fully_shard over dp_shard x cp ({(layout.dp_shard or 1) * cp} ranks), replicated over "
                   f"dp_replicate ({dp // (layout.dp_shard or 1)})"}[layout.dp_mode]
    expert = (f"; experts over ep={layout.ep} of the dp x cp ranks (consecutive dp_index * cp + cp_index, "
              f"all-to-all of the routed tokens)" if layout.ep > 1 else "")
    tensor = f", tp={tp}" if tp > 1 else ""
    formula = ("pp_rank * dp + dp_index" if layout.dp_order == "dp-inner" else "dp_index * pp + pp_rank")
    lines = [f"Mesh (dp={dp}, pp={pp}, cp={cp}{tensor}): {layout.world_size} processes; context parallel: each "
             f"sample's sequence in {2 * cp} chunks, cp rank r holding chunks r and {2 * cp - 1}-r; the cp ranks of "
             f"a stage consecutive (global rank = (({formula}) * cp + cp_index)"
             + (" * tp + tp_index" if tp > 1 else "") + f"); {how}{expert}"]
    for pp_rank in range(pp):
        ranks = [global_rank(layout, d, pp_rank, t, c) for d in range(dp) for c in range(cp) for t in range(tp)]
        lines.append(f"pipeline rank {pp_rank}: global ranks {', '.join(map(str, ranks))}")
    return lines


def describe(plan: dict) -> list:
    """What ``tracepp inspect`` and the rank-script headers show about the mesh (nothing without --dp/--tp)."""
    layout = mesh_layout(plan)
    if layout.cp > 1:
        return _describe_cp(layout)
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
    layout = layout.data_parallel()  # parameters are whole on every cp rank: dp x cp is one data-parallel dim
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


def build_cp_mesh(layout: Layout, device) -> dict:
    """With context parallelism (``cp`` > 1): the job's meshes, on every rank. ``mesh``: dims ("dp", "cp",
    "pp"[, "tp"]) (HSDP: ("dp_replicate", "dp_shard", "cp", "pp"[, "tp"])), ranks as :func:`global_rank`;
    ``grads``: what FSDP/DDP wrap each stage over, dp x cp flattened ("dp_cp"; HSDP: ("dp_replicate",
    "dp_shard_cp")), since every cp rank holds the same parameters and a part of each sample's gradient, as
    torchtitan flattens dp_shard x cp; ``replicas``: the 1-D dp mesh (the loss is averaged over dp only: the cp
    ranks of a replica compute the same loss); ``cp``, ``tp``: 1-D meshes; with ``ep`` > 1 ``ep`` and ``edp``
    from a second mesh ("edp", "ep", "pp"[, "tp"]) over the same ranks, ep taking consecutive indices of the
    flattened dp x cp dim."""
    from torch.distributed.device_mesh import DeviceMesh

    dp, pp, cp, tp = layout.dp, layout.pp, layout.cp, layout.tp
    grid = torch.tensor([[[[global_rank(layout, d, p, t, c) for t in range(tp)] for p in range(pp)]
                          for c in range(cp)] for d in range(dp)])  # (dp, cp, pp, tp)
    names = ("cp", "pp") + (("tp",) if tp > 1 else ())
    body = grid if tp > 1 else grid[..., 0]
    out = {}
    if layout.dp_mode == "hsdp":
        shard = layout.dp_shard
        mesh = DeviceMesh(device.type, body.reshape(dp // shard, shard, *body.shape[1:]),
                          mesh_dim_names=("dp_replicate", "dp_shard") + names)
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        out["grads"] = mesh["dp_replicate", "dp_shard_cp"]
        out["replicas"] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    else:
        mesh = DeviceMesh(device.type, body, mesh_dim_names=("dp",) + names)
        out["grads"] = mesh["dp", "cp"]._flatten("dp_cp")
        out["replicas"] = mesh["dp"]
    out.update(mesh=mesh, cp=mesh["cp"], tp=mesh["tp"] if tp > 1 else None, ep=None, edp=None)
    if layout.ep > 1:
        flat = body.reshape(dp * cp, *body.shape[2:])
        experts = DeviceMesh(device.type, flat.reshape(dp * cp // layout.ep, layout.ep, *flat.shape[1:]),
                             mesh_dim_names=("edp", "ep", "pp") + (("tp",) if tp > 1 else ()))
        out.update(ep=experts["ep"], edp=experts["edp"])
    return out


def dp_mesh(mesh, layout: Layout):
    """The sub-mesh data parallelism runs over: 1-D "dp", or HSDP's 2-D (replicate, shard)."""
    return mesh["dp_replicate", "dp_shard"] if layout.dp_mode == "hsdp" else mesh["dp"]


def wrap_stage(stage, mesh, layout: Layout, ignored=None, sub=None, mp_policy=None):
    """Wrap one StageModule over the dp dim with torch's own engine; returns the same module. ``ignored``: the
    parameters it leaves alone (routed experts, already divided over ep: their gradients are reduced over the
    ranks holding the same experts, ``expert_parallel.reduce_expert_grads``). ``sub``: the mesh to wrap over
    instead of the dp dim (with context parallelism, dp x cp: :func:`build_cp_mesh`'s ``grads``). ``mp_policy``:
    FSDP2's ``MixedPrecisionPolicy`` (``--mixed-precision params``: the parameters gathered and computed in bf16,
    the gradients reduced in fp32; ``precision.mp_policy``), None for none."""
    sub = dp_mesh(mesh, layout) if sub is None else sub
    ignored = set(ignored or ()) or None
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    if layout.dp_mode == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(stage, mesh=sub, ignored_params=ignored, **policy)
    else:
        from torch.distributed.fsdp import fully_shard
        # The stage function reads its parameters directly, not through the blocks' forward, so the stage is
        # the one FSDP unit (a block's own hooks would never run).
        fully_shard(stage, mesh=sub, reshard_after_forward=False, ignored_params=ignored, **policy)
    return stage


def scalars(stages) -> list:
    """The 0-dim parameters of ``stages`` (x-transformers' ``DynamicTanh.pre_tanh_scale``, hyper-connections'
    ``dynamic_alpha_scale = nn.Parameter(torch.ones(()))``): FSDP2 and its replicate refuse them ("fully_shard
    doesn't support scalar parameters"), so :func:`wrap_stage` leaves them out and :func:`reduce_scalar_grads`
    averages their gradients as FSDP/DDP would."""
    return [p for stage in stages for p in stage.parameters() if local(p).dim() == 0]


def reduce_scalar_grads(params: list, mesh, layout: Layout, sub=None) -> None:
    """Average the gradients of :func:`scalars`' parameters over the ranks FSDP/DDP reduce over (``sub``, or the dp
    mesh): one all-reduce per mesh dim of one flat tensor of them all."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    sub = dp_mesh(mesh, layout) if sub is None else sub
    flat = torch.stack([g.reshape(()).float() for g in grads])
    for dim in range(sub.ndim):
        dist.all_reduce(flat, group=sub.get_group(dim))
    flat.div_(sub.size())
    for k, grad in enumerate(grads):
        grad.copy_(flat[k].to(grad.dtype))


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
        return layout.dp * layout.cp
    if layout.dp_mode == "hsdp":
        return layout.dp // layout.dp_shard
    return 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh), or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
