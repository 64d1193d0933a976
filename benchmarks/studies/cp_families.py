"""Context parallelism on transformers' families, a few at a time: ``--cp 2`` at ``--ranks 2`` (pp 2 x cp 2, 2
microbatches), 3 SGD steps on 4 ranks against eager, each family built as the first table of ``docs/families.md``
builds it (``tests/zoo/hf_family.py``: its own config class at a tiny size). The first table has no cp column (a
training run of every family is hours here); this study trains the families a change to the cp rules concerns, for
example the hybrids whose mixers convolve along the sequence, and ``--check`` splits and verifies every family in
well under an hour (the plan against the unsharded stages, no training run)::

    nice -n 5 python -m benchmarks.studies.cp_families --families lfm2,lfm2_moe,qwen3_next
    nice -n 5 python -m benchmarks.studies.cp_families --check --all

Each family runs in its own process (``HF_FAMILY``, the families study's ``run_each``), which writes its record to the
cache folder; a refusal is recorded with its message (it names the op and the
model's source line). Results: ``benchmarks/results/<stamp>_cp_families.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, "out_cp_families")


def whole_record(manifest: dict, limit: int = None) -> dict:
    """What a cp split runs on the whole sequence at every cp rank, as no cp rule places it (the record's fields
    ``whole``, ``whole_ops``: the first ``limit`` of them, ``whole_bytes``) and what verification repaired."""
    whole = [w for stage in manifest["cp"]["stages"] for w in stage.get("whole") or []]
    return {"whole": len(whole), "whole_ops": sorted({f"{w['op']} at {w['line']}" for w in whole})[:limit],
            "whole_bytes": sum(s.get("whole_bytes", 0) for s in manifest["cp"]["stages"]),
            "repairs": manifest["cp"]["verified"].get("repairs", [])}


def run_one(family: str, train: bool = True) -> dict:
    """(in the family's own process) split at pp 2 x cp 2 (the plan verified against the unsharded stages), train 3
    steps and compare with eager (``train``; else the split alone: ``--check``)."""
    for folder in (os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "zoo")):
        sys.path.insert(0, folder)
    sys.path.insert(0, REPO)
    from benchmarks.studies import families

    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout

    record = {"family": family}
    started = time.time()
    try:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "out")
            manifest = split_model(families.PATH, out, num_microbatches=2, layout=Layout(pp=2, cp=2))
            record["verified"] = manifest["cp"]["verified"]["status"]
            record["halos"] = sum(len(s.get("halos") or []) for s in manifest["cp"]["stages"])
            record["scans"] = sum(len(s.get("scans") or []) for s in manifest["cp"]["stages"])
            record.update(whole_record(manifest))
            if train:
                families._run_and_compare(out, 4, record)
    except Exception as error:  # a refusal names the op and the line; anything else is recorded as it came
        record["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
    record["seconds"] = round(time.time() - started, 1)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.cp_families")
    parser.add_argument("--families", default="", help="comma-separated model types (tests/zoo/hf_family.py)")
    parser.add_argument("--cache", default=CACHE, help="each family's record, written by its own process")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per family")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true",
                        help="split and verify only (no training run): every family in minutes, not hours")
    parser.add_argument("--all", action="store_true", help="every family of the first table (tests/zoo/hf_family.py)")
    parser.set_defaults(redo="")  # families.run_each's: every family is run again
    args = parser.parse_args(argv)
    os.makedirs(args.cache, exist_ok=True)
    if args.one:
        record = run_one(args.one, train=not args.check)
        with open(os.path.join(args.cache, args.one + ".json"), "w") as handle:
            json.dump(record, handle)
        print(json.dumps(record), flush=True)
        return 0
    sys.path.insert(0, REPO)
    from benchmarks import write_result
    from benchmarks.studies.families import run_each

    names = [f for f in args.families.split(",") if f]
    if args.all:
        from benchmarks.studies.families import families as every_family
        names = every_family()
    if not names:
        parser.error("--families: name one or more model types (tests/zoo/hf_family.py), e.g. --families lfm2")
    for name in names:  # a record left by an earlier run is not this run's
        if os.path.exists(os.path.join(args.cache, name + ".json")):
            os.remove(os.path.join(args.cache, name + ".json"))
    run_each(names, args, "benchmarks.studies.cp_families", ["--check"] if args.check else [],
             lambda family: dict(os.environ, HF_FAMILY=family, OMP_NUM_THREADS="1"))
    records = []
    for name in names:
        path = os.path.join(args.cache, name + ".json")
        records.append(json.load(open(path)) if os.path.exists(path) else {
            "family": name, "error": f"no record: its process timed out after {args.timeout} s or died (its output "
                                     f"above says which)"})
    import torch
    import transformers

    write_result(args.out, "cp_families", {
        "what": "transformers' families at pp 2 x cp 2 " + ("split and verified against the unsharded stages"
                                                            if args.check else "against eager")
                + " (benchmarks/studies/cp_families.py)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
        "transformers": transformers.__version__, "families": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
