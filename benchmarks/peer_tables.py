"""The tables of docs/benchmarks.md's "Every dimension against torch's own pieces", written from result files.

    python -m benchmarks.peer_tables benchmarks/results/<date>_tensor_parallel_step.json \\
        benchmarks/results/<date>_expert_parallel_step.json benchmarks/results/<date>_tune_sweep.json
    python -m benchmarks.peer_tables benchmarks/results/<date>_cpu_quick.json ...   # suites run with --floor

Prints one markdown table per file (the kind is read from its ``what``): per case tracepp's step, the peer's, the
ratio (the median over paired rounds of the rounds' medians), the CPU-time ratio, the largest parameter
difference between the systems and against eager training, peak memory per rank and the collectives of one step;
for the sweep, the measured plans around the tuner's pick; for ``benchmarks.studies.floor_pairs`` each case's median
ratio of the paired steps; for quick suites run with ``--floor``, one table pooled over
every file given: per case the paired steps' ideal / step of tracepp and of the floor loop (median and quartiles),
and tracepp / floor per round. Nothing is measured here.
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
    if what == "floor_pairs":  # benchmarks.studies.floor_pairs, one file per run of the quick cases
        rows = ["| case | pairs | tracepp / floor, per pair | same losses |", "| --- | --- | --- | --- |"]
        for case, found in record["cases"].items():
            low, high = found["quartiles"]
            rows.append(f"| {case} | {len(found['pairs'])} | {found['tracepp_over_floor']:.3f} [{low:.3f} - "
                        f"{high:.3f}] | {'yes' if found['same_losses'] else 'NO'} |")
        return "\n".join(rows)
    raise ValueError(f"not a result this prints: what={what!r}")


def _spread(values: list) -> str:
    """median [lower quartile - upper quartile] of ``values``."""
    import statistics

    ordered = sorted(values)
    n = len(ordered)
    return f"{statistics.median(ordered):.3f} [{ordered[n // 4]:.3f} - {ordered[(3 * n) // 4]:.3f}]"


def floor_table(records: list) -> str:
    """Quick suites run with ``--floor`` (benchmarks/run.py), pooled: each case's paired steps from every file."""
    pooled: dict = {}
    for record in records:
        for entry in record["results"]:
            floor = entry.get("floor") or {}
            if not floor.get("stepwise") or not (entry.get("ideal") or {}).get("stepwise"):
                continue
            case = pooled.setdefault((entry["schedule"], entry["microbatches"], entry["model"]["name"]),
                                     {"tracepp": [], "floor": [], "rounds": [], "same": True})
            case["tracepp"] += [i / t for i, t in entry["ideal"]["stepwise"]]
            case["floor"] += [i / t for i, t in floor["stepwise"]]
            case["rounds"] += [t / f for t, f in zip(entry["tracepp"]["round_step_s"], floor["round_step_s"])
                               if t and f]
            case["same"] = case["same"] and entry.get("floor_same_losses") is True
    rows = ["| schedule, M | paired steps | ideal / tracepp, per step | ideal / floor, per step | floor steps at >= 0.95 "
            "of their ideal | tracepp / floor, per round | same losses |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for (schedule, m, model), case in pooled.items():
        name = f"{schedule}, {m}" + (f" ({model.split('_')[0]})" if not model.startswith("d") else "")
        share = sum(value >= 0.95 for value in case["floor"]) / len(case["floor"])
        rows.append(f"| {name} | {len(case['tracepp'])} / {len(case['floor'])} | {_spread(case['tracepp'])} | "
                    f"{_spread(case['floor'])} | {share:.0%} | {_spread(case['rounds'])} | "
                    f"{'yes' if case['same'] else 'NO'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    suites = []
    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as handle:
            record = json.load(handle)
        if "results" in record:  # a benchmarks.run suite: pooled below
            suites.append(path)
            continue
        print(f"{path}:\n")
        print(table(record))
        print()
    if suites:
        records = [json.load(open(path)) for path in suites]
        print(", ".join(suites) + " (pooled):\n")
        print(floor_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
