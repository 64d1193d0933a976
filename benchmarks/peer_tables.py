"""The tables of docs/benchmarks.md's "Every dimension against torch's own pieces", written from result files.

    python -m benchmarks.peer_tables benchmarks/results/<date>_tensor_parallel_step.json \\
        benchmarks/results/<date>_expert_parallel_step.json benchmarks/results/<date>_tune_sweep.json

Prints one markdown table per file (the kind is read from its ``what``): per case tracepp's step, the peer's, the
ratio (the median over paired rounds of the rounds' medians), the CPU-time ratio, the largest parameter
difference between the systems and against eager training, peak memory per rank and the collectives of one step;
for the sweep, the measured plans around the tuner's pick. Nothing is measured here.
"""
from __future__ import annotations

import json
import sys


def _ms(value) -> str:
    return f"{value * 1000:.1f}" if value else "-"


def _ops(ops: dict) -> str:
    short = {"c10d::allreduce_": "all-reduce", "c10d::allgather_": "all-gather",
             "c10d::allgather_into_tensor_coalesced_": "all-gather", "c10d::_reduce_scatter_base_": "reduce-scatter",
             "c10d::reduce_scatter_tensor_coalesced_": "reduce-scatter", "c10d::alltoall_base_": "all-to-all",
             "c10d::send": "send", "c10d::recv_": "recv", "c10d::_allgather_base_": "all-gather"}
    counts: dict = {}
    for name, count in (ops or {}).items():
        key = short.get(name, name.replace("c10d::", ""))
        counts[key] = counts.get(key, 0) + count
    return ", ".join(f"{count} {name}" for name, count in sorted(counts.items())) or "-"


def _row(case: str, entry: dict, processes: int) -> str:
    a, b = entry["systems"]["tracepp"], entry["systems"]["torch"]
    memory = entry.get("peak_memory_mb_per_rank") or {}
    ops = entry.get("comm_ops_per_step_rank0") or {}
    eager = entry.get("max_abs_diff_to_eager") or {}
    return (f"| {case} | {processes} | {_ms(a['step_s'])} | {_ms(b['step_s'])} | {entry['ratio_paired']:.3f} | "
            f"{entry['cpu_ratio_paired']:.3f} | {entry['max_abs_diff_tracepp_torch']:.1e} (eager: "
            f"{eager.get('tracepp', 0):.1e} / {eager.get('torch', 0):.1e}) | "
            f"{max(memory.get('tracepp') or [0]):.1f} / {max(memory.get('torch') or [0]):.1f} | "
            f"{_ops(ops.get('tracepp'))} / {_ops(ops.get('torch'))} |")


HEADER = ("| case | processes | tracepp ms | peer ms | tracepp / peer (paired median) | CPU tracepp / peer | "
          "max parameter difference (each against eager) | peak MB per rank, tracepp / peer | collectives per step "
          "on rank 0, tracepp / peer |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table(record: dict) -> str:
    what = record.get("what")
    if what == "step" and "cases" in record:  # benchmarks.tensor_parallel step
        rows = [_row(case, entry, entry["processes"]) for case, entry in record["cases"].items()]
        return "\n".join([HEADER] + rows)
    if what == "step":  # benchmarks.expert_parallel step
        return "\n".join([HEADER, _row("dp2 x ep2", record, record["processes"])])
    if what == "tune_sweep":
        rows = ["| # measured | # predicted | schedule | stages | M | predicted ms | measured ms | / best measured |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        plans = sorted((p for p in record["plans"] if p["measured_s"]), key=lambda p: p["measured_s"])
        shown = plans[:5] + [p for p in plans[5:] if p["predicted_rank"] == 1]
        for p in shown:
            plan = p["plan"]
            rows.append(f"| {p['measured_rank']} | {p['predicted_rank']} | {plan['schedule']} | {plan['num_stages']} | "
                        f"{plan['num_microbatches']} | {_ms(p['predicted_s'])} | {_ms(p['measured_s'])} | "
                        f"{p['over_best_measured']:.3f} |")
        pick = record["pick"]
        rows.append(f"\n{record['measured']} of {record['priced']} plans measured; the pick ranks "
                    f"#{pick['measured_rank']}, {pick['over_best_measured']:.3f} x the best measured; --measure K: "
                    + ", ".join(f"K={k} {v['over_best_measured']:.3f}" for k, v in record["measure_k"].items())
                    + f"; Spearman {record['spearman_predicted_vs_measured']:.2f}")
        return "\n".join(rows)
    raise ValueError(f"not a result this prints: what={what!r}")


def main(argv=None) -> int:
    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as handle:
            record = json.load(handle)
        print(f"{path}:\n")
        print(table(record))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
