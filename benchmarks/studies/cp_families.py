"""Context parallelism on transformers' families, a few at a time: ``--cp 2`` at ``--ranks 2`` (pp 2 x cp 2, 2
microbatches), 3 SGD steps on 4 ranks against eager, each family built as the first table of ``docs/families.md``
builds it (``tests/zoo/hf_family.py``: its own config class at a tiny size). The first table has no cp column (a run
of every family is hours here); this study measures the families a change to the cp rules concerns, for example the
hybrids whose mixers convolve along the sequence::

    nice -n 5 python -m benchmarks.studies.cp_families --families lfm2,lfm2_moe,qwen3_next

Each family runs in its own process (``HF_FAMILY``); a refusal is recorded with its message (it names the op and the
model's source line). Results: ``benchmarks/results/<stamp>_cp_families.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_one(family: str) -> dict:
    """(in the family's own process) split at pp 2 x cp 2, train 3 steps, compare with eager."""
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
            families._run_and_compare(out, 4, record)
    except Exception as error:  # a refusal names the op and the line; anything else is recorded as it came
        record["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
    record["seconds"] = round(time.time() - started, 1)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.cp_families")
    parser.add_argument("--families", required=True, help="comma-separated model types (tests/zoo/hf_family.py)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per family")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("RECORD " + json.dumps(run_one(args.one)))
        return 0
    records = []
    for family in [f for f in args.families.split(",") if f]:
        env = dict(os.environ, HF_FAMILY=family, OMP_NUM_THREADS="1")
        try:
            done = subprocess.run([sys.executable, "-m", "benchmarks.studies.cp_families", "--families", family,
                                   "--one", family], cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RECORD ")]
            record = json.loads(lines[-1][7:]) if lines else {
                "family": family, "error": "no record: " + (done.stderr or "")[-1500:]}
        except subprocess.TimeoutExpired:
            record = {"family": family, "error": f"timed out after {args.timeout} s"}
        print(json.dumps(record), flush=True)
        records.append(record)
    sys.path.insert(0, REPO)
    import torch
    import transformers

    from benchmarks import write_result

    write_result(args.out, "cp_families", {
        "what": "transformers' families at pp 2 x cp 2 against eager (benchmarks/studies/cp_families.py)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
        "transformers": transformers.__version__, "families": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
