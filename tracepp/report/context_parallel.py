"""``tracepp inspect`` and ``tracepp check`` with ``--cp``: how the sequence is spread and what the ranks exchange."""
from __future__ import annotations

from tabulate import tabulate

from tracepp.report.stages import verified_lines


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.3f} MB" if count >= 1e5 else f"{count:,} B"


def context_parallel_table(manifest: dict) -> str:
    """The chunk order, per stage the values made for this rank's positions and the key/value all-gathers (whole
    bytes per microbatch, what each rank receives), the values sent between stages as shards, and the loss's sum
    and count. Empty without --cp."""
    cp = manifest.get("cp")
    if not cp:
        return ""
    size = cp["size"]
    lines = [f"context parallel (cp={size}): each sample's sequence of {cp['sequence']} positions in {2 * size} "
             f"chunks, cp rank r holding chunks r and {2 * size - 1}-r; every value with the sequence dim holds 1/cp "
             f"of it; attention all-gathers keys and values (backward reduce-scatters dK and dV)"]
    rows = []
    for index, stage in enumerate(cp["stages"]):
        gathered = stage.get("gathered", [])
        shapes = {}
        for item in gathered:
            key = f"{item['dtype']}[{', '.join(item['shape'])}]"
            shapes[key] = shapes.get(key, 0) + 1
        text = "; ".join(f"{n} x {shape}" for shape, n in shapes.items()) or "none"
        rows.append([index, text, _megabytes(stage.get("kv_bytes", 0)),
                     _megabytes(stage.get("kv_received_bytes_per_rank", 0)),
                     len(stage.get("cut", [])) + stage.get("positions", 0), len(stage.get("reduced", []))])
    lines.append(tabulate(rows, headers=["stage", "key/value all-gathers per microbatch (whole)", "whole bytes",
                                         "received per rank", "made for its positions", "reductions over seq"],
                          tablefmt="simple"))
    for index, stage in enumerate(cp["stages"]):
        halos = stage.get("halos") or []
        if halos:
            reaches = sorted({item["reach"] for item in halos})
            lines.append(f"stage {index}: {len(halos)} causal convolution(s) along the sequence, each chunk given the "
                         f"{'/'.join(map(str, reaches))} position(s) before it by the rank that holds them (cp_halo: "
                         f"{_megabytes(sum(item['bytes'] for item in halos))} all-gathered per microbatch, whole)")
        whole = stage.get("whole") or []
        if whole:
            ops = {}
            for item in whole:
                key = f"{item['op']}{' at ' + item['line'] if item.get('line') else ''}"
                ops[key] = ops.get(key, 0) + 1
            listed = ", ".join(f"{key}{f' x {n}' if n > 1 else ''}" for key, n in list(ops.items())[:6])
            more = f" and {len(ops) - 6} more" if len(ops) > 6 else ""
            lines.append(f"stage {index}: {len(whole)} op(s) on the whole sequence at every cp rank, as no cp rule "
                         f"places them ({listed}{more}): their shards all-gathered first "
                         f"({_megabytes(stage.get('whole_bytes', 0))} per microbatch, whole), their compute not "
                         f"divided by cp; why: {whole[0]['why']}")
        scans = stage.get("scans") or []
        if scans:
            lines.append(f"stage {index}: {len(scans)} running sum(s) along the sequence "
                         f"({', '.join(sorted({s['op'] for s in scans}))}), each chunk's plus the totals of the chunks "
                         f"before it (every chunk's total all-gathered)")
    record = cp.get("verified")
    ran = (record or {}).get("ran") or []
    lines += verified_lines(record, "every stage's" + (" and the loss's" if "the loss" in ran else "") + " cp ranks")
    if record and record.get("scope"):
        lines.append(f"  verified: {record['scope']}")
    if cp.get("sent"):
        lines.append("sent between stages as shards (1/cp of the bytes): " + ", ".join(sorted(cp["sent"])))
    loss = cp.get("loss") or {}
    if loss.get("reductions"):
        reduced = ", ".join(f"{r['op']} ({r['reduction']}{', ' + r['line'] if r.get('line') else ''})"
                            for r in loss["reductions"])
        lines.append(f"loss: {reduced}: a sum and a count, each all-reduced over cp (exact with uneven padding)")
    if loss.get("whole"):
        lines.append("loss: " + ", ".join(f"{w['op']}{' at ' + w['line'] if w.get('line') else ''}"
                                          for w in loss["whole"]) + " on the whole sequence at every cp rank")
    return "\n".join(lines)
