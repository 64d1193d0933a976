"""``tracepp plan OUT --tune``: search schedule, stages per rank, microbatch count and split points with the
calibrated simulator and the memory model; print the best plans; ``--apply`` splits the folder again with the best.

The search (plain data, deterministic, seconds):

* **schedules**: every name of ``codegen.schedules.SCHEDULE_TABLE`` (those that split the backward into I and W
  are left out with ``--dp``), on the folder's ranks;
* **stages**: one per rank, or two (V schedules), or 2, 3 or 4 per rank for the schedules that take any multiple,
  as far as the model has segments (repeated blocks and top-level modules) to cut between;
* **microbatches**: the divisors of the batch (per data-parallel replica) up to :data:`MAX_MICROBATCHES`, as far
  as the schedule allows;
* **split points** for each stage count: the automatic balancer's cuts (``split.cost.choose_cuts`` on the
  manifest's segment table: the largest stage's FLOPs, then memory), the cuts that balance the *calibrated*
  segment times instead, and the folder's own split where its stage count matches.

Each candidate is planned by the planner (``codegen.plan.build_plan``, as ``tracepp split`` would) and timed by
the calibrated simulator (``tracepp.costs.model``): stage costs of another split from the calibrated segment
times, at the candidate's microbatch size; boundary messages from the tensors that cross each cut. Peak memory
per rank: its stages' parameters, gradients and optimizer state (``--optimizer-bytes-per-param``, Adam's 8 by
default) plus, at the worst moment of the simulated timeline, the activations of the microbatches whose forward
has run and whose backward (B, or I) has not, each a stage's activation bytes at that microbatch size
(``split.cost``'s estimate: every floating value that needs a gradient; an upper bound). Candidates over
``--memory-limit`` are dropped.

**Tensor parallelism** (``--tp-sizes``): each candidate is priced again at every tp size from the segment
table's figures (``split.tensor_parallel.segment_figures``): the sharded share of the compute divided by tp, the
collectives tp adds, the sharded parameters, gradients and optimizer state divided by tp, and the activations
computed on shards divided by tp. Where the split recorded a sequence-parallel walk for that tp, the candidate
is priced a second time with ``--sequence-parallel``: the activations between the regions are divided by tp as
well (not the all-gathered input of a column-parallel region, which its linears keep whole), each row-wise
all-reduce becomes a reduce-scatter and each region's input an all-gather (mirrored in backward), and the
values that cross a pipeline cut as sequence shards send 1/tp of their bytes. A folder split by an older tracepp
(no activation figures) keeps activations whole and is not priced with sequence parallelism.

**Expert parallelism** (``--ep-sizes``, from a folder split at ``--dp N`` without ``--ep``): each candidate is
priced again at every ep size that divides N and every block's expert count, from the segment table's routed
expert figures (``split.expert_parallel.expert_figures``):

* memory per rank: the expert weights, their gradients and optimizer state divided by ep (outside FSDP, nothing
  gathered). At ep 1 they are FSDP's like every other parameter, and this runtime's FSDP
  (``reshard_after_forward=False``, ``runtime/mesh.py``) holds a stage's weights and gradients gathered whole
  from its first forward to its last backward of the step, beside its 1/dp shard of the weights and optimizer
  state: that is what a rank holds at the worst moment, and what :func:`held_bytes` counts for every parameter
  at ``--dp`` (DDP: all of it, everywhere);
* time per microbatch and block: the all-to-alls of dispatch (the per-expert counts, then the rows) and
  combine, forward, and the two row exchanges again backward (:func:`all_to_all_s`: ep - 1 messages of 1/ep of
  the rows a rank holds, priced from the all-to-all ``tracepp calibrate`` fits on ranks 0 and 1);
* time per step and stage (beside its optimizer step): at ep 1 FSDP's all-gather of the expert weights and
  reduce-scatter of their gradients over dp (once per step, as this runtime runs FSDP: not per microbatch); at
  ep > 1 the all-reduce of the expert gradients over the dp / ep ranks holding the same experts (none at
  ep = dp). dp's traffic for the other parameters is the same at every ep and, as before, not priced;
* the optimizer step: its share of the calibrated seconds follows the parameters a rank updates;
* compute: unchanged. With balanced routing a rank computes the same expert FLOPs at every ep: at ep 1 its own
  microbatch's rows through all E experts, at ep > 1 the rows that ep ranks route to its E / ep experts (about
  as many). What ep divides is the expert FLOPs *of the rows a rank routes* (1/ep of them run at home) and the
  FLOPs *per expert weight a rank holds*, not the FLOPs a rank runs.

Expert parallelism adds no process (it is carved out of dp), so ep sizes compete on step time alone; ties go to
the smaller ep.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tracepp.costs.model import (Calibration, message_bytes, predict_plan, same_model, segment_lines, split_costs,
                                 split_optimizer, stage_of_segments, traced_microbatch)
from tracepp.codegen.memory import NEXT_MODE as _NEXT_MODE, RECOMPUTE_SHARE
from tracepp.costs import context_parallel
from tracepp.runtime.mesh import mesh_layout

MAX_MICROBATCHES = 128
STAGES_PER_RANK_MULTIPLE = (2, 3, 4)  # for schedules that take any multiple of the ranks
ADAM_BYTES_PER_PARAM = 8


@dataclass
class Candidate:
    schedule: str
    num_stages: int
    num_microbatches: int
    split: tuple  # stage of each segment
    split_points: list  # module FQNs where stages 1.. begin
    split_source: str  # "balancer", "calibrated times", "this folder"
    step_s: float = 0.0  # predicted; a plan over --memory-limit is not simulated (0.0) unless it is the folder's own
    bubble: float = 0.0
    peak_memory: dict = field(default_factory=dict)  # rank -> bytes
    stage_to_rank: list = field(default_factory=list)
    error: Optional[str] = None
    tp: int = 1  # tensor-parallel ranks per stage: the job runs ranks x tp processes (x dp)
    sequence_parallel: bool = False  # with tp > 1: activations between the tp regions split over the sequence
    ep: int = 1  # expert-parallel ranks, carved out of dp (no more processes)
    cp: int = 1  # context-parallel ranks per stage: the job runs ranks x tp x cp processes (x dp)
    recompute: Optional[list] = None  # activation checkpointing per stage chosen to fit --memory-limit (None: none)

    @property
    def checkpointing(self) -> str:
        """The ``--activation-checkpointing`` value of this plan: none, or one mode per stage."""
        modes = self.recompute or []
        if not modes or all(m == "none" for m in modes):
            return "none"
        return modes[0] if len(set(modes)) == 1 else ",".join(modes)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // max(1, len(set(self.stage_to_rank)))

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                "tp": self.tp, "sequence_parallel": self.sequence_parallel, "ep": self.ep, "cp": self.cp,
                "activation_checkpointing": self.checkpointing, "split_points": self.split_points,
                "split_source": self.split_source, "step_s": self.step_s,
                "bubble": self.bubble, "peak_memory_bytes": {str(r): v for r, v in sorted(self.peak_memory.items())}}


def parse_bytes(text: str) -> int:
    """``20GB``, ``512MiB``, ``1.5G``, ``1000000`` -> bytes (GB = 1e9, GiB = 2^30)."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"--memory-limit {text!r}: give a size such as 20GB, 512MiB or 1.5e9")
    number, prefix, binary = float(match[1]), match[2].upper(), match[3]
    power = "KMGT".index(prefix) + 1 if prefix else 0
    return int(number * ((1024 if binary else 1000) ** power))


def _divisors(n: int, limit: int) -> list:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def stage_counts(schedule: str, num_ranks: int, num_segments: int) -> list:
    from tracepp.codegen.schedules import schedule_info

    info = schedule_info(schedule)
    if info.stage_counts == "one":
        counts = [num_ranks]
    elif info.stage_counts == "two":
        counts = [2 * num_ranks]
    else:
        counts = [v * num_ranks for v in STAGES_PER_RANK_MULTIPLE]
    return [c for c in counts if c <= num_segments]


def _cuts_to_split(cuts: list, num_segments: int) -> tuple:
    stage, out, cut_set = 0, [], set(cuts)
    for index in range(num_segments):
        if index in cut_set:
            stage += 1
        out.append(stage)
    return tuple(out)


def candidate_splits(manifest: dict, calibration: Calibration, num_stages: int, schedule: str,
                     num_microbatches: int, microbatch_size: float, training: bool,
                     optimizer_bytes_per_param: int) -> list:
    """[(stage of each segment, source)] for ``num_stages`` stages: the balancer's cuts, the cuts balancing the
    calibrated times, the folder's own split (when it has that many stages); duplicates removed."""
    from tracepp.split import cost

    segments = manifest["segments"]
    pieces = [cost.SegmentCost(seg["forward_flops"] or 0, seg["num_params"] or 0, seg["param_bytes"] or 0,
                               seg["activation_bytes"] or 0) for seg in segments]

    def memory_of(stage_index: int, stage_cost) -> int:
        inflight = cost.inflight_microbatches(schedule, stage_index, num_stages, num_microbatches, training)
        return cost.stage_estimate(stage_cost, inflight, training, optimizer_bytes_per_param)["memory_bytes"]

    found = []
    if num_stages <= len(segments):
        found.append((_cuts_to_split(cost.choose_cuts(pieces, num_stages, memory_of), len(segments)), "balancer"))
        lines = segment_lines(calibration)
        if lines is not None:
            timed = []
            for seg, piece in zip(lines, pieces):
                seconds = sum(max(a + c * microbatch_size, 0.0) for kind, (a, c) in seg.items() if kind in ("F", "B"))
                timed.append(cost.SegmentCost(int(seconds * 1e9), piece.num_params, piece.param_bytes,
                                              piece.activation_bytes))
            found.append((_cuts_to_split(cost.choose_cuts(timed, num_stages, memory_of), len(segments)),
                          "calibrated times"))
    own = stage_of_segments(manifest)
    if own is not None and own[-1] + 1 == num_stages:
        found.append((tuple(own), "this folder"))
    unique, seen = [], {}
    for split, source in found:
        if split in seen:
            continue
        seen[split] = source
        unique.append((split, source))
    return unique


def _split_points(manifest: dict, split: tuple) -> list:
    segments = manifest["segments"]
    return [segments[i]["begins"] for i in range(1, len(split)) if split[i] != split[i - 1]]


def _messages(manifest: dict, split: tuple, microbatch_size: float, precision: str, own: bool, tp: int = 1,
              sequence_parallel: bool = False) -> dict:
    """Boundary messages per microbatch of a split. With sequence parallelism each pipeline rank's tp ranks send
    their counterparts the sequence shards of the values that cross a cut so (``cut_sequence_bytes`` of the
    cut entering the consumer stage): 1/tp of those bytes."""
    if own:
        out = message_bytes(manifest, microbatch_size, precision)
    else:
        scale = microbatch_size / traced_microbatch(manifest)
        wire = 0.5 if precision in ("bf16", "fp16") else 1.0
        out = {}
        segments = manifest["segments"]
        for i in range(1, len(split)):
            if split[i] != split[i - 1]:
                seg = segments[i]
                stage = split[i]
                out[(stage - 1, stage, "F")] = (max(1, seg["cut_tensors"]), seg["cut_bytes"] * scale * wire)
                out[(stage - 1, stage, "B")] = (max(1, seg.get("cut_grad_tensors", 1)),
                                                seg["cut_grad_bytes"] * scale * wire)
    if not sequence_parallel:
        return out
    kept = {}  # consumer stage -> (forward, backward) fraction of the cut before it left per rank
    for i in range(1, len(split)):
        if split[i] != split[i - 1]:
            seg = manifest["segments"][i]
            fig = _tp_figures(seg, tp, True)
            kept[split[i]] = tuple(1.0 - (fig[key] / seg[total]) * (1 - 1 / tp) if seg[total] else 1.0
                                   for key, total in (("cut_sequence_bytes", "cut_bytes"),
                                                      ("cut_sequence_grad_bytes", "cut_grad_bytes")))
    return {(producer, consumer, kind): (count, size * kept.get(consumer, (1.0, 1.0))[kind != "F"])
            for (producer, consumer, kind), (count, size) in out.items()}


_NO_TP = {"sharded_flops": 0, "sharded_params": 0, "sharded_param_bytes": 0, "all_reduce": [0, 0],
          "all_reduce_backward": [0, 0], "all_gather": [0, 0], "all_gather_backward": [0, 0]}


def _tp_figures(seg: dict, tp: int, sequence_parallel: bool = False) -> dict:
    """A segment's tensor-parallel figures at ``tp`` (``split.tensor_parallel.segment_figures``; its
    sequence-parallel ones with ``sequence_parallel``); zeros at tp 1."""
    if tp == 1:
        return dict(_NO_TP)
    figures = seg["tp"][str(tp)]
    return figures["sequence_parallel"] if sequence_parallel else figures


def sequence_parallel_priced(manifest: dict, tp: int) -> bool:
    """Whether the split recorded sequence-parallel figures for ``tp`` on every segment (a split by an older
    tracepp, a model without a sequence dim, or a sequence length ``tp`` does not divide has none)."""
    return tp > 1 and all("sequence_parallel" in ((seg.get("tp") or {}).get(str(tp)) or {})
                          for seg in manifest["segments"])


def collective_links(calibration) -> dict:
    """{op: (latency s, bandwidth bytes/s) per ring step}: the calibrated all-reduce and all-gather of two ranks
    (``tracepp.costs.measure_comm.collectives_on_two``), else the point-to-point link of ranks 0 and 1 (a ring
    step is one message; gloo's collectives on CPU measured 2-6x slower than that, see benchmarks.md). A
    reduce-scatter's step is the all-reduce's (it sums as it goes: an all-reduce is a reduce-scatter then an
    all-gather). ``all_to_all``: one message of the calibrated 2-rank all-to-all (:func:`all_to_all_s`)."""
    fitted = (calibration.comm or {}).get("collectives") or {}
    links = {}
    for op in ("all_reduce", "all_gather"):
        entry = fitted.get(op)
        links[op] = ((float(entry["step_latency_s"]), entry["step_bandwidth_bytes_per_s"]) if entry
                     else calibration.link(0, 1))
    links["reduce_scatter"] = links["all_reduce"]
    entry = fitted.get("all_to_all")  # a calibration from before it was measured: one point-to-point message
    links["all_to_all"] = ((float(entry["step_latency_s"]), entry["step_bandwidth_bytes_per_s"]) if entry
                           else calibration.link(0, 1))
    return links


def collective_s(op: str, count: int, total_bytes: float, tp: int, link) -> float:
    """Ring collectives over ``tp`` ranks (``link``: (latency s, bandwidth bytes/s) per ring step, or
    :func:`collective_links`' dict by op): an all-reduce is 2 (tp - 1) steps of a 1/tp piece, an all-gather and
    a reduce-scatter (tp - 1) steps each, so the two cost what one all-reduce does; ``total_bytes`` is the whole
    tensors'."""
    if tp == 1 or count == 0:
        return 0.0
    if isinstance(link, dict):  # a reduce-scatter's step is the all-reduce's where no link of its own is given
        latency, bandwidth = link[op] if op in link else link["all_reduce"]
    else:
        latency, bandwidth = link
    steps = 2 * (tp - 1) if op == "all_reduce" else tp - 1
    wire = total_bytes / tp / bandwidth if bandwidth else 0.0
    return steps * (count * latency + wire)


def all_to_all_s(count: int, total_bytes: float, ep: int, link) -> float:
    """``count`` all-to-alls over ``ep`` ranks in which each rank holds ``total_bytes`` (summed over the calls)
    with even splits, as expert parallelism's dispatch and combine run with balanced routing (``link``: (latency
    s, bandwidth bytes/s) per message, or :func:`collective_links`' dict, whose ``all_to_all`` it takes).

    The model: a pairwise exchange, ep - 1 messages of 1/ep of the bytes per call, one after another:
    ``(ep - 1) x (latency + bytes / ep / bandwidth)``. Whatever the algorithm, a rank sends (ep - 1) / ep of its
    rows and receives as many, so the bandwidth term holds for any schedule of the messages; a latency per message,
    one message after another, is an upper bound where the backend overlaps them (gloo with a core per rank did:
    the price was 1.4 - 2.0x its measured time at 4 and 8 ranks, ``benchmarks.expert_parallel alltoall``), and
    the 2-rank fit it is priced from is exactly one such message (``measure_comm.collectives_on_two``). It is the
    all-gather's form (ep - 1 steps of a 1/ep piece): the same bytes leave each rank."""
    if ep == 1 or count == 0:
        return 0.0
    latency, bandwidth = link["all_to_all"] if isinstance(link, dict) else link
    wire = total_bytes / ep / bandwidth if bandwidth else 0.0
    return (ep - 1) * (count * latency + wire)


def _expert_blocks(manifest: dict, split: tuple) -> dict:
    """{stage: [block figures]} of a split (``segments[k]["ep"]["blocks"]``)."""
    out: dict = {}
    for seg, stage in zip(manifest["segments"], split):
        out.setdefault(stage, []).extend((seg.get("ep") or {}).get("blocks", []))
    return out


def expert_exchange_s(manifest: dict, split: tuple, microbatch_size: float, ep: int, link,
                      precision: str = "fp32") -> dict:
    """{stage: (forward s, backward s)} per microbatch of the all-to-alls expert parallelism adds at ``ep``: per
    block, forward the per-expert counts (int64), the rows to the experts (``pairs x row_bytes``) and their
    outputs back (``pairs x out_row_bytes``); backward the gradients of both row exchanges. ``pairs`` scale with
    the microbatch size; the rows travel in the activations' dtype (halved under bf16/fp16 precision)."""
    if ep == 1:
        return {}
    scale = microbatch_size / traced_microbatch(manifest)
    wire = 0.5 if precision in ("bf16", "fp16") else 1.0
    out = {}
    for stage, blocks in _expert_blocks(manifest, split).items():
        forward = backward = 0.0
        for block in blocks:
            rows_in = block["pairs"] * block["row_bytes"] * scale * wire
            rows_out = block["pairs"] * block["out_row_bytes"] * scale * wire
            forward += all_to_all_s(1, block["experts"] * 8, ep, link)  # the counts, then the rows
            forward += all_to_all_s(2, rows_in + rows_out, ep, link)
            backward += all_to_all_s(2, rows_in + rows_out, ep, link)
        out[stage] = (forward, backward)
    return out


def expert_bytes(manifest: dict, split: tuple) -> dict:
    """{stage: (routed expert parameters, their bytes)} of a split."""
    out: dict = {}
    for seg, stage in zip(manifest["segments"], split):
        fig = seg.get("ep") or {}
        count, size = out.get(stage, (0, 0))
        out[stage] = (count + fig.get("params", 0), size + fig.get("param_bytes", 0))
    return out


def _dp_shard(layout) -> int:
    """How many ranks FSDP shards a stage's parameters over (1: DDP, or no dp)."""
    if layout.dp == 1 or layout.dp_mode == "ddp":
        return 1
    return layout.dp if layout.dp_mode == "fsdp" else (layout.dp_shard or 1)


def compute_copy_share(manifest: dict):
    """Bytes of the copy a stage computes with per byte of the weights a rank holds, under ``--mixed-precision
    params`` (bf16 over fp32 masters: 0.5), from the manifest's state entries (``compute_dtype``); None where the
    stages compute with the parameters themselves (fp32, autocast): FSDP then gathers them whole, in their dtype."""
    import torch

    for stage in manifest.get("stages", []):
        for ref in stage.get("state", []):
            if ref.get("compute_dtype"):
                held = getattr(torch, ref["dtype"]).itemsize
                return getattr(torch, ref["compute_dtype"]).itemsize / held
    return None


def held_bytes(param_bytes: float, count: float, layout, training: bool, optimizer_bytes_per_param: int,
               experts_over: int = 1, copy=None) -> float:
    """What a group of parameters costs one rank at the worst moment of a training step: weights, gradients and
    optimizer state. ``experts_over`` > 1: routed experts sharded over that many ep ranks, outside FSDP: 1/ep of
    each, nothing gathered. Otherwise by the data-parallel mode: whole on every rank without dp or with DDP; under
    FSDP (HSDP: over its shard group) this runtime keeps a stage's weights gathered and its gradients whole from
    the first forward to the last backward of a step (``reshard_after_forward=False``, gradient sync in the last
    backward only), beside its 1/dp shard of the weights and the optimizer state: whole weights and gradients
    plus 1/dp of weights and optimizer state. ``copy`` (:func:`compute_copy_share`): under ``--mixed-precision
    params`` the gathered weights are the compute copy (half of fp32's at bf16), and without FSDP that copy is made
    beside the weights."""
    grads = param_bytes if training else 0.0
    state = count * optimizer_bytes_per_param if training else 0.0
    cast = param_bytes * copy if copy else 0.0
    if experts_over > 1:
        return (param_bytes + grads + state + cast) / experts_over
    shard = _dp_shard(layout)
    if shard == 1:
        return param_bytes + grads + state + cast
    return param_bytes * (copy or 1.0) + grads + (param_bytes + state) / shard


def expert_step_s(manifest: dict, split: tuple, layout, ep: int, link) -> dict:
    """{stage: s} per step of the data-parallel traffic of the routed experts at ``ep``: at ep 1 FSDP's
    all-gather of the expert weights and reduce-scatter of their gradients over dp (HSDP: over its shard group,
    then an all-reduce over the replicas; DDP: an all-reduce), once per step as this runtime runs FSDP
    (``reshard_after_forward=False``); at ep > 1 the all-reduce of each rank's experts' gradients over the dp / ep
    ranks that hold the same experts (``runtime/expert_parallel.reduce_expert_grads``; nothing at ep = dp)."""
    out = {}
    for stage, (_count, size) in expert_bytes(manifest, split).items():
        if not size or layout.dp == 1:
            continue
        if ep > 1:
            seconds = collective_s("all_reduce", 1, size / ep, layout.dp // ep, link)
        elif layout.dp_mode == "ddp":
            seconds = collective_s("all_reduce", 1, size, layout.dp, link)
        else:
            shard = _dp_shard(layout)
            seconds = (collective_s("all_gather", 1, size, shard, link)
                       + collective_s("reduce_scatter", 1, size, shard, link)
                       + collective_s("all_reduce", 1, size / shard, layout.dp // shard, link))
        out[stage] = seconds
    return out


def ep_of_split(manifest: dict, ep_sizes: Optional[list]) -> Optional[list]:
    """``[ep]`` for a folder split with ``--ep`` (priced as it was split), None for one split without; ``--ep-sizes``
    asking a folder split with ``--ep`` for other sizes is refused, naming the split that prices them. Reads the
    plan only: ``plan --tune`` checks it before computing any figure."""
    layout = mesh_layout(manifest["plan"])
    if layout.ep <= 1:
        return None
    if ep_sizes and sorted(set(ep_sizes)) != [layout.ep]:
        raise ValueError(f"--ep-sizes {','.join(map(str, ep_sizes))}: this folder was split with --ep "
                         f"{layout.ep}; calibrate and tune its ep=1 split (`tracepp split` with --dp {layout.dp} "
                         f"and without --ep) to price other ep sizes")
    return [layout.ep]


def expert_sizes(manifest: dict, ep_sizes: Optional[list]) -> list:
    """The ep sizes ``--ep-sizes`` may price for this folder, checked: each must divide the folder's ``--dp`` and
    every routed block's expert count, on a folder split without ``--ep`` whose segment table records the blocks;
    the error names the sizes that work."""
    split_with = ep_of_split(manifest, ep_sizes)
    if split_with is not None:
        return split_with
    layout = mesh_layout(manifest["plan"])
    ep_sizes = sorted(set(ep_sizes or [1]))
    if ep_sizes == [1]:
        return ep_sizes
    blocks = [block for seg in manifest["segments"] for block in (seg.get("ep") or {}).get("blocks", [])]
    if not blocks:
        raise ValueError(f"--ep-sizes {','.join(map(str, ep_sizes))}: this folder's segment table records no "
                         f"routed experts (a model without them, or split by an older tracepp): split it again "
                         f"with this tracepp, or tune without --ep-sizes")
    refused = next((b for b in blocks if b.get("refused")), None)
    if refused is not None:
        raise ValueError(f"--ep-sizes: the routed experts of {refused['name']} cannot be sharded "
                         f"({refused['refused']}): tune without --ep-sizes")
    counts = sorted({block["experts"] for block in blocks})
    works = [k for k in range(1, layout.dp + 1) if layout.dp % k == 0 and all(c % k == 0 for c in counts)]
    if layout.dp_mode == "hsdp":
        works = [1]
    for ep in ep_sizes:
        if ep not in works:
            why = ("expert parallelism takes its ranks from the data-parallel ranks, which --dp-mode hsdp already "
                   "splits in two" if layout.dp_mode == "hsdp" else
                   f"an ep size must divide --dp {layout.dp} (expert parallelism is carved out of the data-parallel "
                   f"ranks) and the {' and '.join(map(str, counts))} routed experts of every block")
            raise ValueError(f"--ep-sizes {ep}: {why}; use ep sizes in {works}"
                             + (" (or split with a larger --dp)" if layout.dp_mode != "hsdp" else ""))
    return ep_sizes


# (op, figure) per direction: sequence parallelism's reduce-scatters run as all-gathers backward and its
# all-gathers into the regions as reduce-scatters
_FORWARD = (("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
            ("all_gather", "all_gather_sequence"))
_BACKWARD = (("all_reduce", "all_reduce_backward"), ("all_gather", "reduce_scatter"),
             ("reduce_scatter", "all_gather_sequence"), ("all_gather", "all_gather_backward"))


def tp_costs(manifest: dict, split: tuple, costs: dict, microbatch_size: float, tp: int, link: tuple,
             precision: str = "fp32", sequence_parallel: bool = False) -> dict:
    """``{(stage, kind): s}`` of a split priced at ``tp``: each segment's sharded share of its FLOPs divided by
    tp (the calibrated time scaled by FLOPs), and the collectives it adds: forward all-reduces and all-gathers
    on F, the backward all-reduces on B and I; with ``sequence_parallel`` also its reduce-scatters and
    all-gathers, on F and mirrored on B and I."""
    if tp == 1:
        return costs
    scale = microbatch_size / traced_microbatch(manifest)
    wire = 0.5 if precision in ("bf16", "fp16") else 1.0
    flops, sharded, forward, backward = {}, {}, {}, {}

    def priced(fig, ops) -> float:
        return sum(collective_s(op, fig[key][0], fig[key][1] * scale * wire, tp, link)
                   for op, key in ops if key in fig)

    for seg, stage in zip(manifest["segments"], split):
        fig = _tp_figures(seg, tp, sequence_parallel)
        flops[stage] = flops.get(stage, 0) + (seg["forward_flops"] or 0)
        sharded[stage] = sharded.get(stage, 0) + fig["sharded_flops"]
        forward[stage] = forward.get(stage, 0.0) + priced(fig, _FORWARD)
        backward[stage] = backward.get(stage, 0.0) + priced(fig, _BACKWARD)
    out = {}
    for (stage, kind), seconds in costs.items():
        share = sharded.get(stage, 0) / flops[stage] if flops.get(stage) else 0.0
        priced = seconds * (1.0 - share + share / tp)
        if kind == "F":
            priced += forward.get(stage, 0.0)
        elif kind in ("B", "I"):
            priced += backward.get(stage, 0.0)
        out[(stage, kind)] = priced
    return out


def _memory(manifest: dict, split: tuple, sim, stage_to_rank: list, microbatch_size: float, training: bool,
            optimizer_bytes_per_param: int, tp: int = 1, sequence_parallel: bool = False, ep: int = 1,
            layout=None, recompute=None, actions=None, releases=None, ranks=None, cache=None) -> dict:
    """Peak bytes per rank. With the split's counted figures (``segments[k]["memory"]``: what each segment keeps
    per microbatch under each activation checkpointing mode, and its stage's temporaries) and the plan's actions,
    each rank's timeline is walked as ``tracepp split`` walks its own plan (``codegen.peak.rank_peak``) with
    stage figures made of the segments: kept bytes, temporaries, receive buffers and the outputs they free from
    the cuts, the parameters, gradients and optimizer state as :func:`held_bytes` says (FSDP's gathered copy, 1/ep
    of the experts), activations computed on tp shards divided by tp (:func:`_activation_share`). ``recompute``:
    each stage's checkpointing (default none). A folder split without those figures: the old upper bound (every
    value that carries a gradient, live from its forward to its backward in the simulated timeline). ``ranks``:
    only these ranks' peaks, with the counted figures (a stage's figures depend on its own checkpointing only);
    ``cache``: :func:`stage_memory`'s, for calls that differ in ``recompute`` only."""
    from tracepp.runtime.mesh import Layout

    layout = layout or Layout()
    segments = manifest["segments"]
    if actions is not None and all(seg.get("memory") for seg in segments):
        wanted = None if ranks is None else {s for s, r in enumerate(stage_to_rank) if r in ranks}
        figures, optimizer = stage_memory(manifest, split, microbatch_size, training, optimizer_bytes_per_param,
                                          tp, sequence_parallel, ep, layout, recompute, wanted, cache)
        from tracepp.codegen.peak import RankActions, rank_peak

        peak = {}
        for rank, rank_actions in actions.items():
            rank = int(rank)
            if ranks is not None and rank not in ranks:
                continue
            mine = {s: figures[s] for s, r in enumerate(stage_to_rank) if r == rank}
            state = sum(optimizer.get(s, 0) for s in mine)
            rank_releases = (releases or {}).get(rank, (releases or {}).get(str(rank)))
            if cache is not None:  # the actions parsed once for every trial
                if ("actions", rank) not in cache:
                    cache[("actions", rank)] = RankActions(rank_actions, rank_releases)
                rank_actions = cache[("actions", rank)]
            ranked = rank_peak(rank_actions, mine, {"state_bytes": state, "step_peak": 0}, layout.dp_mode, layout.dp,
                               rank_releases, (manifest.get("run_options") or {}).get("device", "cpu"))
            peak[rank] = int(ranked["peak_bytes"])
        return peak
    scale = microbatch_size / traced_microbatch(manifest)
    static, activation = {}, {}
    for seg, stage in zip(segments, split):
        held = _held(seg, tp, sequence_parallel, ep, layout, training, optimizer_bytes_per_param,
                     compute_copy_share(manifest))
        static[stage] = static.get(stage, 0) + held
        activation[stage] = activation.get(stage, 0) + (seg["activation_bytes"] or 0) * _activation_share(
            seg, tp, sequence_parallel) * scale
    peak = {}
    for rank, entries in sim.timeline.items():
        live, now, worst = set(), 0.0, 0.0
        for action, _start, _end in entries:
            if action.kind == "F":
                live.add((action.stage, action.mb))
                now += activation.get(action.stage, 0)
            elif action.kind in ("B", "I") and (action.stage, action.mb) in live:
                live.discard((action.stage, action.mb))
                now -= activation.get(action.stage, 0)
            worst = max(worst, now)
        peak[rank] = int(sum(static.get(s, 0) for s, r in enumerate(stage_to_rank) if r == rank) + worst)
    return peak


def _activation_share(seg: dict, tp: int, sequence_parallel: bool) -> float:
    """The share of a segment's activations a rank keeps at ``tp``: those computed on shards (and, with sequence
    parallelism, those between the regions) divided by tp (the split's walk records their bytes)."""
    total = seg.get("activation_bytes") or 0
    if tp == 1 or not total:
        return 1.0
    fig = _tp_figures(seg, tp, sequence_parallel)
    sharded = fig.get("sharded_activation_bytes", 0) + fig.get("sequence_activation_bytes", 0)
    return max(0.0, (total - sharded * (1 - 1 / tp)) / total)


def _held(seg: dict, tp: int, sequence_parallel: bool, ep: int, layout, training: bool,
          optimizer_bytes_per_param: int, copy=None) -> float:
    fig = _tp_figures(seg, tp, sequence_parallel)
    experts = seg.get("ep") or {}
    expert_bytes_, expert_count = experts.get("param_bytes", 0), experts.get("params", 0)
    params = (seg["param_bytes"] or 0) - fig["sharded_param_bytes"] * (1 - 1 / tp) - expert_bytes_
    count = (seg["num_params"] or 0) - fig["sharded_params"] * (1 - 1 / tp) - expert_count
    return (held_bytes(params, count, layout, training, optimizer_bytes_per_param, copy=copy)
            + held_bytes(expert_bytes_, expert_count, layout, training, optimizer_bytes_per_param, ep, copy))


def stage_memory(manifest: dict, split: tuple, microbatch_size: float, training: bool, optimizer_bytes_per_param: int,
                 tp: int = 1, sequence_parallel: bool = False, ep: int = 1, layout=None, recompute=None,
                 stages=None, cache: Optional[dict] = None) -> tuple:
    """({stage: figures for ``codegen.peak.rank_peak``}, {stage: optimizer state bytes}) of a split, made of its
    segments' counted figures (see :func:`_memory`); ``recompute[stage]``: none, selective or full. ``stages``:
    only these; ``cache``: (stage, mode) -> its answer, for a caller that asks again with only some stages' modes
    changed (the other arguments the same)."""
    from tracepp.runtime.mesh import Layout

    layout = layout or Layout()
    segments = manifest["segments"]
    scale = microbatch_size / traced_microbatch(manifest)
    shard = _dp_shard(layout)
    wrapped = layout.dp > 1
    copy = compute_copy_share(manifest)  # --mixed-precision params: the compute copy's bytes per master byte
    figures, optimizer = {}, {}
    every = sorted(set(split))
    first_segment = {stage: split.index(stage) for stage in every}
    for stage in (every if stages is None else sorted(stages)):
        mode = (recompute[stage] if recompute else "none")
        if cache is not None and (stage, mode) in cache:
            figures[stage], optimizer[stage] = cache[(stage, mode)]
            continue
        members = [seg for seg, owner in zip(segments, split) if owner == stage]
        share = [_activation_share(seg, tp, sequence_parallel) for seg in members]
        kept = sum(seg["memory"].get(mode, seg["memory"].get("none", {})).get("kept", 0) * f
                   for seg, f in zip(members, share)) * scale
        mean_share = sum(share) / len(share) if share else 1.0

        def most(key):
            return max(seg["memory"].get(mode, seg["memory"].get("none", {})).get(key, 0) for seg in members) \
                * mean_share * scale

        cut_in = segments[first_segment[stage]] if first_segment[stage] > 0 else None
        nxt = first_segment.get(stage + 1)
        cut_out = segments[nxt] if nxt is not None else None
        wire = 1.0
        received = (cut_in["cut_bytes"] or 0) * scale * wire if cut_in else 0
        outputs = (cut_out["cut_bytes"] or 0) * scale if cut_out else 0
        input_grads = (cut_in.get("cut_grad_bytes") or 0) * scale if cut_in else 0
        grad_in = (cut_out.get("cut_grad_bytes") or 0) * scale * wire if cut_out else 0
        params = experts = count = expert_count = 0.0
        for seg in members:
            fig = _tp_figures(seg, tp, sequence_parallel)
            found = seg.get("ep") or {}
            experts += found.get("param_bytes", 0) / ep
            expert_count += found.get("params", 0) / ep
            params += (seg["param_bytes"] or 0) - fig["sharded_param_bytes"] * (1 - 1 / tp) - found.get("param_bytes", 0)
            count += (seg["num_params"] or 0) - fig["sharded_params"] * (1 - 1 / tp) - found.get("params", 0)
        grads = (params + experts) if training else 0
        figures[stage] = {
            "kept": kept, "forward_peak": most("forward_peak"), "backward_peak": most("backward_peak"),
            "backward_peak_first": most("backward_peak_first"), "freed_at_send": outputs,
            "after_backward": -(kept - outputs) + input_grads, "after_backward_first": -(kept - outputs) + input_grads + grads,
            "input_backward_peak": most("backward_peak"), "after_input_backward": -(kept - outputs) + input_grads,
            "weight_backward_peak": most("backward_peak"), "weight_backward_peak_first": most("backward_peak_first"),
            "after_weight_backward": 0, "after_weight_backward_first": grads,
            "input_grads": input_grads, "grads": grads,
            "received_sizes": [received] if received else [], "grad_received_sizes": [grad_in] if grad_in else [],
            # what the stage computes with from its first forward to its last backward: FSDP's (DDP's) gathered
            # copy, in the compute dtype under the params policy, whose cast copy exists without dp too (and of the
            # routed experts, which FSDP leaves alone)
            "param_bytes": params / shard + experts,
            "unsharded_bytes": (params * (copy or 1.0) if wrapped else params * (copy or 0.0)) + experts * (copy or 0.0),
            "grad_bytes_at_rest": (params / shard + experts) if training else 0}
        optimizer[stage] = (count / shard + expert_count) * optimizer_bytes_per_param if training else 0
        if cache is not None:
            cache[(stage, mode)] = (figures[stage], optimizer[stage])
    return figures, optimizer


def tune(manifest: dict, calibration: Calibration, memory_limit: Optional[int] = None,
         schedules: Optional[list] = None, microbatch_counts: Optional[list] = None,
         optimizer_bytes_per_param: int = ADAM_BYTES_PER_PARAM, precision: str = "fp32",
         tp_sizes: Optional[list] = None, ep_sizes: Optional[list] = None, cp_sizes: Optional[list] = None) -> tuple:
    """Every candidate priced (see the module doc): (kept, sorted by predicted GPU-seconds per step, i.e. step
    time x processes, so a larger tp wins only where it pays for its processes; dropped over the memory limit;
    failed to plan, with the planner's reason). ``tp_sizes``: tensor-parallel sizes to price each candidate
    at (default: the folder's own, 1); ``ep_sizes``: expert-parallel sizes (default 1; see
    :func:`expert_sizes`)."""
    from tracepp.codegen.plan import build_plan
    from tracepp.codegen.schedules import SCHEDULE_TABLE
    from tracepp.codegen.manifest import topology_from_manifest
    from tracepp.runtime.actions import Topology

    if not manifest.get("segments"):
        raise ValueError("this folder's manifest has no segment table (split by an older tracepp): split it again "
                         "to tune")
    if not same_model(calibration, manifest):
        raise ValueError("the calibration was measured on another model or an older split of it: calibrate this "
                         f"folder (`tracepp calibrate {manifest.get('_folder', 'OUT')}`)")
    if segment_lines(calibration) is None:
        raise ValueError("the calibrated split does not begin its stages at segment boundaries (repeated blocks, "
                         "top-level modules), so its stage times cannot be shared out to other splits: calibrate "
                         "a folder split at module FQNs")
    plan = manifest["plan"]
    layout = mesh_layout(plan)
    num_ranks = layout.pp
    training = manifest["training"]
    batch = manifest["batch_size"]
    counts = microbatch_counts or _divisors(batch, MAX_MICROBATCHES)
    names = schedules or list(SCHEDULE_TABLE)
    if layout.tp > 1:
        raise ValueError("this folder was split with --tp: calibrate and tune its tp=1 split (`tracepp split` "
                         "without --tp), and price tp with --tp-sizes")
    segments = manifest["segments"]
    tp_sizes = sorted(set(tp_sizes or [1]))
    for tp in tp_sizes:
        if tp != 1 and any(str(tp) not in (seg.get("tp") or {}) for seg in segments):
            known = sorted({int(k) for seg in segments for k in (seg.get("tp") or {})})
            raise ValueError(f"--tp-sizes {tp}: this folder holds tensor-parallel figures for tp in {[1] + known} "
                             f"only (the whole graph could not be walked at tp {tp}: `tracepp check MODEL --tp {tp}` "
                             f"says why); tune without tp {tp}")
    # each tp > 1 with and without sequence parallelism, where the split recorded its figures
    layouts = [(tp, sp) for tp in tp_sizes for sp in (False, True) if not sp or sequence_parallel_priced(manifest, tp)]
    ep_sizes = expert_sizes(manifest, ep_sizes)
    cp_sizes = context_parallel.cp_sizes(manifest, cp_sizes)  # priced by tracepp/costs/context_parallel.py
    link = collective_links(calibration)
    own_split = stage_of_segments(manifest)
    own_topology = topology_from_manifest(manifest)
    kept, dropped, failed = [], [], []
    plans: dict = {}  # the plan does not depend on the split, only on its topology
    for schedule in names:
        for num_stages in stage_counts(schedule, num_ranks, len(segments)):
            for num_microbatches in counts:
                size = batch / num_microbatches
                splits = candidate_splits(manifest, calibration, num_stages, schedule, num_microbatches, size,
                                          training, optimizer_bytes_per_param)
                for split, source in splits:
                    own = own_split is not None and tuple(own_split) == split
                    candidate = Candidate(schedule, num_stages, num_microbatches, split, _split_points(manifest, split),
                                          source)
                    topology = own_topology if own else Topology.chain(num_stages)
                    key = (schedule, num_stages, num_microbatches, topology)
                    if key not in plans:
                        try:
                            plans[key] = build_plan(schedule, num_ranks, num_stages, num_microbatches, topology,
                                                    training)
                        except ValueError as error:
                            plans[key] = str(error)
                    built = plans[key]
                    if isinstance(built, str):
                        candidate.error = built
                        failed.append(candidate)
                        continue
                    costs = split_costs(calibration, list(split), size)  # at tp 1; each tp prices them anew
                    optimizer = split_optimizer(calibration, list(split))
                    for (tp, sp), ep, cp in ((pair, ep, cp) for pair in layouts for ep in ep_sizes for cp in cp_sizes):
                        candidate = Candidate(schedule, num_stages, num_microbatches, split,
                                              _split_points(manifest, split), source, tp=tp, sequence_parallel=sp,
                                              ep=ep, cp=cp)
                        view = context_parallel.cp_view(manifest, cp, tp)  # cp's share of activations, tp's figures
                        held_layout = context_parallel.cp_layout(layout, cp)  # FSDP's shards over dp x cp
                        optimizer_s = {stage: seconds * _sharded_share(manifest, split, stage, tp, sp, ep, layout)
                                       * context_parallel.cp_optimizer_share(layout, cp)
                                       for stage, seconds in optimizer.items()}
                        for stage, seconds in expert_step_s(manifest, split, layout, ep, link).items():
                            optimizer_s[stage] = optimizer_s.get(stage, 0.0) + seconds
                        messages = context_parallel.cp_messages(
                            manifest, split, _messages(manifest, split, size, precision, own, tp, sp), cp)
                        priced = context_parallel.cp_costs(manifest, split,
                                                           tp_costs(view, split, costs, size, tp, link, precision, sp),
                                                           size, cp, link, tp, precision)
                        # expert FLOPs per rank are the same at every ep (the module doc): only the exchange is added
                        exchange = expert_exchange_s(manifest, split, size, ep, link, precision)
                        priced = {(stage, kind): seconds + (exchange[stage][0] if kind == "F" else
                                                            exchange[stage][1] if kind in ("B", "I") else 0.0)
                                  if stage in exchange else seconds for (stage, kind), seconds in priced.items()}
                        def predict(step_costs):
                            prediction = predict_plan(built.actions, built.stage_to_rank, topology, num_microbatches,
                                                      step_costs, calibration, messages, optimizer_s, training,
                                                      check=False)
                            candidate.step_s, candidate.bubble = prediction.step_s, prediction.bubble
                            return prediction

                        candidate.stage_to_rank = list(built.stage_to_rank)
                        # with counted figures the memory is the ranks' timelines (no simulation): a plan is
                        # simulated once, with the checkpointing it fits by, and one that fits by none is not
                        # simulated at all unless it is the folder's own (``current_candidate`` prints its time)
                        sim = None if _counted(view) else predict(priced).sim
                        candidate.peak_memory = _memory(view, split, sim, built.stage_to_rank, size, training,
                                                        optimizer_bytes_per_param, tp, sp, ep, held_layout, None,
                                                        built.actions, built.releases)
                        step_costs = priced
                        if memory_limit is not None and max(candidate.peak_memory.values()) > memory_limit:
                            modes, peaks = choose_recompute(
                                view, split, built, size, training, optimizer_bytes_per_param, tp, sp, ep,
                                held_layout, memory_limit, priced)
                            if peaks and any(mode != "none" for mode in modes):
                                step_costs, sim = recompute_costs(priced, modes), None
                                candidate.recompute, candidate.peak_memory = modes, peaks
                        fits = memory_limit is None or max(candidate.peak_memory.values()) <= memory_limit
                        if sim is None and (fits or _is_folder_plan(candidate, manifest)):
                            predict(step_costs)
                        (kept if fits else dropped).append(candidate)
    order = {name: index for index, name in enumerate(SCHEDULE_TABLE)}
    kept.sort(key=lambda c: (round(c.step_s * c.tp * c.cp, 12), order.get(c.schedule, 99), c.num_stages,
                             c.num_microbatches, c.split, c.tp, c.sequence_parallel, c.ep, c.cp))
    return kept, dropped, failed


def recompute_costs(costs: dict, modes: list) -> dict:
    """``{(stage, kind): s}`` with each stage's backward (B, or I where it is split) paying for the forward its
    checkpointing (``modes[stage]``) recomputes: :data:`RECOMPUTE_SHARE` of its forward time."""
    out = dict(costs)
    for (stage, kind), seconds in costs.items():
        if kind in ("B", "I") and stage < len(modes):
            out[(stage, kind)] = seconds + RECOMPUTE_SHARE[modes[stage]] * costs.get((stage, "F"), 0.0)
    return out


def choose_recompute(manifest: dict, split: tuple, built, microbatch_size: float, training: bool,
                     optimizer_bytes_per_param: int, tp: int, sequence_parallel: bool, ep: int, layout,
                     memory_limit: int, costs: dict) -> tuple:
    """Activation checkpointing per stage for a plan over ``memory_limit``: (modes, peak per rank). Starting from
    none everywhere, while a rank is over the limit, one of its stages goes further (none -> selective -> full, or
    straight to full where selective saves nothing): the move that saves the most of that rank's peak per second of
    recomputation it adds. A stage's need
    follows from the schedule: the first stage of 1F1B keeps pp microbatches in flight, the last one, so the
    first ones are checkpointed first. Stops when every rank fits or no stage is left to checkpoint."""
    num_stages = len(set(split))
    modes = ["none"] * num_stages
    if not all(seg.get("memory") for seg in manifest["segments"]):  # split by an older tracepp: nothing counted
        return modes, {}
    if not all({"none", "selective", "full"} <= set(seg["memory"]) for seg in manifest["segments"]):
        raise ValueError("this folder's memory was counted under its own activation checkpointing only: the tuner "
                         "needs every mode's figures (`tracepp plan OUT --tune` counts them first; from Python, "
                         "tracepp.tuner_figures.ensure(manifest, OUT))")
    cache: dict = {}  # each stage's figures per mode, computed once
    peaks = _memory(manifest, split, None, built.stage_to_rank, microbatch_size, training, optimizer_bytes_per_param,
                    tp, sequence_parallel, ep, layout, modes, built.actions, built.releases, cache=cache)
    while max(peaks.values()) > memory_limit:
        worst = max(peaks, key=peaks.get)
        best = None
        for stage in (s for s, r in enumerate(built.stage_to_rank) if r == worst and modes[s] in _NEXT_MODE):
            further = _NEXT_MODE[modes[stage]]
            while further is not None:  # the next mode and those past it (selective may save nothing where full does)
                trial = list(modes)
                trial[stage] = further
                found = dict(peaks)  # the trial changes the worst rank's stage: the other ranks' peaks stand
                found.update(_memory(manifest, split, None, built.stage_to_rank, microbatch_size, training,
                                     optimizer_bytes_per_param, tp, sequence_parallel, ep, layout, trial,
                                     built.actions, built.releases, ranks={worst}, cache=cache))
                saved = peaks[worst] - found[worst]
                added = (RECOMPUTE_SHARE[further] - RECOMPUTE_SHARE[modes[stage]]) * costs.get((stage, "F"), 0.0)
                score = saved / added if added > 0 else saved * 1e12
                if saved > 0 and (best is None or score > best[0]):
                    best = (score, trial, found)
                further = _NEXT_MODE.get(further)
        if best is None:
            break
        _score, modes, peaks = best
    return modes, peaks


def _sharded_share(manifest: dict, split: tuple, stage: int, tp: int, sequence_parallel: bool = False, ep: int = 1,
                   layout=None) -> float:
    """The fraction of a stage's optimizer work left per rank at ``tp`` and ``ep``, against the calibrated folder
    (tp 1, ep 1): the parameters a rank updates, the tp-sharded ones' (tp - 1) / tp less, and at ep > 1 the
    routed experts 1/ep of them where FSDP gave each rank 1/dp (DDP: all) of them before."""
    total = sharded = experts = 0
    for seg, owner in zip(manifest["segments"], split):
        if owner == stage:
            total += seg["num_params"] or 0
            sharded += _tp_figures(seg, tp, sequence_parallel)["sharded_params"]
            experts += (seg.get("ep") or {}).get("params", 0) if ep > 1 else 0
    if not total:
        return 1.0
    shard = _dp_shard(layout) if layout is not None else 1
    held = (total - sharded * (1 - 1 / tp) - experts) / shard + experts / ep
    if layout is not None and layout.ep > 1 and ep == layout.ep:  # an ep folder priced as it was calibrated
        return 1.0 - (sharded / total) * (1 - 1 / tp)
    return held / (total / shard)


def _mb(value: float) -> str:
    return f"{value / 1e6:,.1f}"


def format_tuning(kept: list, dropped: list, failed: list, top: int, memory_limit: Optional[int],
                  current: Optional[Candidate] = None) -> str:
    from tabulate import tabulate

    rows = []
    for rank_index, c in enumerate(kept[:top], 1):
        rows.append([rank_index, c.schedule, f"{c.num_stages} ({c.stages_per_rank}/rank)", c.num_microbatches, c.tp,
                     ("yes" if c.sequence_parallel else "no") if c.tp > 1 else "-", c.ep, c.cp,
                     _runs_text(c.checkpointing.split(",")), _cuts_text(c.split_points)
                     + (f"  [{c.split_source}]" if c.split_source != "balancer" else ""),
                     f"{c.step_s * 1000:.1f}", f"{c.bubble:.1%}",
                     " / ".join(_mb(v) for _, v in sorted(c.peak_memory.items()))])
    headers = ["#", "schedule", "stages", "M", "tp", "sp", "ep", "cp", "checkpointing", "split points", "step ms",
               "bubble", "peak MB per rank"]
    lines = [tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)]
    searched = len(kept) + len(dropped) + len(failed)
    summary = f"{searched} candidates: {len(kept) + len(dropped)} plans priced"
    if memory_limit is not None:
        summary += f" ({len(kept)} within --memory-limit {_mb(memory_limit)} MB, {len(dropped)} over it)"
    if failed:
        summary += f", {len(failed)} the planner refused (e.g. {failed[0].schedule} M={failed[0].num_microbatches}: " \
                   f"{failed[0].error.split(';')[0]})"
    lines.append(summary)
    if current is not None:
        lines.append(f"this folder's plan ({current.schedule}, {current.num_stages} stages, M={current.num_microbatches})"
                     f": predicted {current.step_s * 1000:.1f} ms")
    return "\n".join(lines)


LONG = 6  # more entries than this print shortened (a 405B plan has 64 stages: `plan --apply` writes them all)


def _runs_text(modes: list) -> str:
    """Stage modes as printed: ``none,full`` as they are; a long list as runs, ``selective x59, none x5``."""
    if len(modes) <= LONG:
        return ",".join(modes)
    runs: list = []
    for mode in modes:
        if runs and runs[-1][0] == mode:
            runs[-1][1] += 1
        else:
            runs.append([mode, 1])
    return ", ".join(f"{mode} x{count}" for mode, count in runs)


def _cuts_text(points: list) -> str:
    if len(points) <= LONG:
        return ", ".join(points)
    return f"{', '.join(points[:2])} ... {points[-1]} ({len(points)} cuts)"


def current_candidate(kept: list, dropped: list, manifest: dict) -> Optional[Candidate]:
    return next((c for c in kept + dropped if _is_folder_plan(c, manifest)), None)


def _is_folder_plan(c: Candidate, manifest: dict) -> bool:
    """Whether ``c`` is the plan the folder was split with (its schedule, microbatches and split, tp, ep, cp 1)."""
    plan = manifest["plan"]
    own = stage_of_segments(manifest)
    return (c.schedule == plan["schedule"] and c.num_microbatches == plan["num_microbatches"] and c.tp == 1
            and c.ep == 1 and c.cp == 1 and own is not None and c.split == tuple(own))


def _counted(manifest: dict) -> bool:
    """Whether the split counted each segment's memory (``_memory`` walks the ranks' timelines, not a simulation)."""
    return all(seg.get("memory") for seg in manifest["segments"])
