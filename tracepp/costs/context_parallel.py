"""``plan --tune --cp-sizes``: the price of context parallelism, from the segment table's figures
(``split.context_parallel.segment_figures``, recorded by every ``tracepp split``).

At ``cp`` ranks per stage (each holding 1/cp of every sample's sequence):

* **compute**: the FLOPs computed on sequence shards divided by cp (attention too: each rank's queries against
  every key, with the 2 x cp chunk order balancing causal attention's work) — the calibrated stage times scaled
  by the segments' share of those FLOPs;
* **collectives per microbatch**: forward the all-gather of each attention's keys and values (``kv_gather``, the
  whole bytes, moved up past head repeats), backward the reduce-scatter of dK and dV, each cp - 1 ring steps of a
  1/cp piece (:func:`tracepp.costs.search.collective_s`, the calibrated all-gather and all-reduce steps); the
  inputs of ops no cp rule places (``whole_gather``: all-gathered so they run on the whole sequence, their FLOPs
  outside the sharded share) alike; the partial sums over the sequence are a few bytes and priced as all-reduces;
* **boundaries**: the values that cross a cut as sequence shards send 1/cp of their bytes;
* **memory**: the activations held on shards divided by cp; parameters are whole on every cp rank, their FSDP
  shards spread over dp x cp (:meth:`tracepp.runtime.mesh.Layout.data_parallel`), which also shares out the
  optimizer step;
* **processes**: cp multiplies them, so the search ranks by step time x tp x cp.

With tp the two compose on their figures: tp's collectives and activation figures were counted on the whole
sequence and are divided by cp (each runs on 1/cp of it), the key/value bytes by tp (heads sharded). A folder
split with ``--cp`` is priced from its cp=1 split, as ``--tp`` is.
"""
from __future__ import annotations

import copy
from typing import Optional

import sympy

from tracepp.runtime.mesh import mesh_layout


def cp_sizes(manifest: dict, sizes: Optional[list]) -> list:
    """The cp sizes ``--cp-sizes`` may price for this folder, checked: a folder split without ``--cp``, whose
    segment table records the cp figures and whose traced sequence ``2 x cp`` divides; the error names the sizes
    that work."""
    sizes = sorted(set(sizes or [1]))
    if sizes == [1]:
        return sizes
    layout = mesh_layout(manifest["plan"])
    if layout.cp > 1:
        raise ValueError(f"this folder was split with --cp {layout.cp}: calibrate and tune its cp=1 split "
                         f"(`tracepp split` without --cp) to price cp sizes")
    segments = manifest.get("segments") or []
    figures = [seg.get("cp") for seg in segments]
    if not segments or any(f is None for f in figures):
        raise ValueError("--cp-sizes: the split recorded no context-parallel figures (a model without a batched "
                         "[batch, sequence] input, or a folder split by an older tracepp): split it again")
    refused = next((f["refused"] for f in figures if f.get("refused")), None)
    if refused:
        raise ValueError(f"--cp-sizes: this model cannot be split with --cp: {refused}")
    length = sympy.sympify(figures[0]["sequence"])
    if length.is_Integer:
        works = [c for c in range(1, int(length) // 2 + 1) if int(length) % (2 * c) == 0]
        bad = [c for c in sizes if c > 1 and c not in works]
        if bad:
            raise ValueError(f"--cp-sizes {','.join(map(str, sizes))}: the traced sequence of {int(length)} tokens "
                             f"does not cut into 2 x cp chunks for cp in {bad}; use cp in {works[:8]}")
    return sizes


def cp_view(manifest: dict, cp: int, tp: int = 1) -> dict:
    """The manifest as the memory pricing should see it at ``cp``: each segment's activations less (cp - 1)/cp of
    those held on sequence shards (its counted kept bytes and temporaries, ``segments[k]["memory"]``, scaled
    alike), its cuts less (cp - 1)/cp of the values sent as shards, tp's per-segment figures (counted on the whole
    sequence) divided by cp. A copy; the folder's manifest is untouched."""
    if cp == 1:
        return manifest
    view = dict(manifest)
    view["segments"] = []
    for seg in manifest["segments"]:
        fig = seg.get("cp") or {}
        new = copy.deepcopy(seg)
        total = seg["activation_bytes"] or 0
        new["activation_bytes"] = int(total - fig.get("sequence_activation_bytes", 0) * (1 - 1 / cp))
        share = new["activation_bytes"] / total if total else 1.0
        for figures in (new.get("memory") or {}).values():  # the counted kept bytes and temporaries per mode
            if isinstance(figures, dict):
                for key, value in figures.items():
                    if isinstance(value, (int, float)):
                        figures[key] = value * share
        for key, sent in (("cut_bytes", "cut_sequence_bytes"), ("cut_grad_bytes", "cut_sequence_grad_bytes")):
            if new.get(key):  # the receive buffers of a cut: its shards 1/cp (messages: cp_messages, from the
                new[key] = new[key] - fig.get(sent, 0) * (1 - 1 / cp)  # folder's own values)
        for entry in (new.get("tp") or {}).values():
            for figures in (entry, entry.get("sequence_parallel") or {}):
                for key in ("sharded_activation_bytes", "sequence_activation_bytes", "cut_sequence_bytes",
                            "cut_sequence_grad_bytes"):
                    if key in figures:
                        figures[key] = figures[key] / cp
                for key in ("all_reduce", "all_reduce_backward", "all_gather", "all_gather_backward",
                            "reduce_scatter", "all_gather_sequence"):
                    if key in figures:
                        figures[key] = [figures[key][0], figures[key][1] / cp]
        view["segments"].append(new)
    return view


def cp_layout(layout, cp: int):
    """The layout the memory pricing sees at ``cp``: dp x cp as one data-parallel dim (FSDP's shards)."""
    return layout.replace(cp=cp).data_parallel() if cp > 1 else layout


def cp_costs(manifest: dict, split: tuple, costs: dict, microbatch_size: float, cp: int, link, tp: int = 1,
             precision: str = "fp32") -> dict:
    """``{(stage, kind): s}`` of a split priced at ``cp`` (from its prices at cp 1, tp's included): the share
    of each stage's FLOPs computed on sequence shards divided by cp, the key/value all-gathers on F and their
    reduce-scatters on B and I (an input-gradient backward carries them: dK and dV are input gradients)."""
    if cp == 1:
        return costs
    from tracepp.costs.model import traced_microbatch
    from tracepp.costs.search import collective_s

    scale = microbatch_size / traced_microbatch(manifest)
    wire = 0.5 if precision in ("bf16", "fp16") else 1.0
    flops, sharded, forward, backward = {}, {}, {}, {}
    for seg, stage in zip(manifest["segments"], split):
        fig = seg.get("cp") or {}
        flops[stage] = flops.get(stage, 0) + (seg["forward_flops"] or 0)
        sharded[stage] = sharded.get(stage, 0) + fig.get("sharded_flops", 0)
        count, size = fig.get("kv_gather", [0, 0])
        kv = size * scale * wire / tp
        sums = fig.get("sums", [0, 0])
        wholes, whole_size = fig.get("whole_gather", [0, 0])  # the inputs of ops run on the whole sequence
        whole = whole_size * scale * wire
        forward[stage] = forward.get(stage, 0.0) + collective_s("all_gather", count, kv, cp, link) \
            + collective_s("all_gather", wholes, whole, cp, link) \
            + collective_s("all_reduce", sums[0], sums[1] * scale, cp, link)
        backward[stage] = backward.get(stage, 0.0) + collective_s("reduce_scatter", count, kv, cp, link) \
            + collective_s("reduce_scatter", wholes, whole, cp, link) \
            + collective_s("all_reduce", sums[0], sums[1] * scale, cp, link)
    out = {}
    for (stage, kind), seconds in costs.items():
        share = sharded.get(stage, 0) / flops[stage] if flops.get(stage) else 0.0
        priced = seconds * (1.0 - share + share / cp)
        if kind == "F":
            priced += forward.get(stage, 0.0)
        elif kind in ("B", "I"):
            priced += backward.get(stage, 0.0)
        out[(stage, kind)] = priced
    return out


def cp_messages(manifest: dict, split: tuple, messages: dict, cp: int) -> dict:
    """Boundary messages at ``cp``: of each cut, the values sent as sequence shards carry 1/cp of their bytes."""
    if cp == 1:
        return messages
    kept = {}
    for i in range(1, len(split)):
        if split[i] != split[i - 1]:
            seg = manifest["segments"][i]
            fig = seg.get("cp") or {}
            kept[split[i]] = tuple(1.0 - (fig.get(key, 0) / seg[total]) * (1 - 1 / cp) if seg[total] else 1.0
                                   for key, total in (("cut_sequence_bytes", "cut_bytes"),
                                                      ("cut_sequence_grad_bytes", "cut_grad_bytes")))
    return {(producer, consumer, kind): (count, size * kept.get(consumer, (1.0, 1.0))[kind != "F"])
            for (producer, consumer, kind), (count, size) in messages.items()}


def cp_optimizer_share(layout, cp: int) -> float:
    """The optimizer step's work per rank at ``cp`` against the calibrated folder: FSDP (HSDP) spreads its shards
    over dp x cp (1/cp of the folder's); DDP updates every parameter on every rank."""
    if cp == 1 or layout.dp_mode == "ddp":
        return 1.0
    return 1.0 / cp
