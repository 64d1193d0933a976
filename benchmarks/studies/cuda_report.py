"""Gather the GPU measurements of one session into one JSON and a PNG.

    python -m benchmarks.studies.cuda_report --stage stage_eager.json stage_compiled.json [...] --predict predict.json \
        --cuda-path cuda_path.json --profile profile.json --out benchmarks/results/DATE_cuda

The inputs are the ``--json`` files of ``benchmarks.gpu_stage``, ``benchmarks.gpu_predict``,
``benchmarks.cuda_path`` and ``benchmarks.studies.gpu_profile_stage``; rows are copied, not recomputed. The PNG shows
the measured MFU per system (left) and the predicted step time and bubble of each multi-GPU schedule (right).
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", nargs="+", default=[], help="benchmarks.gpu_stage JSON files, in order")
    parser.add_argument("--predict", default=None)
    parser.add_argument("--cuda-path", default=None)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--notes", default="")
    parser.add_argument("--out", required=True, help="path without extension")
    args = parser.parse_args()
    load = lambda path: json.load(open(path)) if path else None  # noqa: E731
    stages = [load(path) for path in args.stage]
    report = {"measured": {"stage_runs": stages, "cuda_path": load(args.cuda_path), "profile": load(args.profile)},
              "predicted": load(args.predict), "notes": args.notes}
    with open(args.out + ".json", "w") as handle:
        json.dump(report, handle, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {args.out}.json (no matplotlib: no PNG)")
        return
    rows, seen = [], set()  # the first run that measured a system is plotted; later runs stay in the JSON
    for run in stages:
        for row in run["systems"]:
            if "mfu" in row and row["system"] not in seen:
                seen.add(row["system"])
                rows.append(row)
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.tick_params(axis="x", labelsize=8)
    left.bar([row["system"].replace("-", "\n") for row in rows], [100 * row["mfu"] for row in rows], color="tab:blue")
    for index, row in enumerate(rows):
        left.text(index, 100 * row["mfu"] + 0.5, f"{100 * row['mfu']:.1f}%", ha="center")
    device = stages[0]["device"] if stages else "GPU"
    left.set_ylabel("MFU (% of dense bf16 peak)")
    left.set_title(f"measured: Llama-7B stage (8 layers), {device}", fontsize=9)
    if report["predicted"]:
        preds = report["predicted"]["predictions"]
        labels = [f"{p['gpus']} GPU\n{p['schedule']}" for p in preds]
        right.bar(labels, [p["predicted_step_s"] for p in preds], color="tab:orange", label="predicted step")
        right.bar(labels, [p["ideal_step_s"] for p in preds], color="none", edgecolor="black", label="no-bubble ideal")
        for index, p in enumerate(preds):
            right.text(index, p["predicted_step_s"] + 0.02, f"{100 * p['bubble']:.0f}%", ha="center", fontsize=7)
        right.set_ylabel("seconds per step (16 microbatches)")
        right.set_title("predicted (simulator, NVLink model): Llama-7B, bubble % on bars", fontsize=9)
        right.tick_params(axis="x", labelsize=6)
        right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.out + ".png", dpi=110)
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
