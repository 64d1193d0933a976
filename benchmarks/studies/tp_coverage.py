"""How much of each decoder layer ``--tp 2`` shards, per Hugging Face family of ``tests/zoo/tp_hf.py`` (hidden
32, 4 query heads, 2 key/value heads, 2 layers) at microbatch sizes 1 and 2 (pp 2, a batch of 4), with and
without ``--sequence-parallel``: the parameters (elements, from ``model().named_parameters()``) whose plan
entry has a shard dim, over those of the layer. Mixtral's routed experts and router are counted apart (they
stay whole over tp and shard over ``--ep``). Plans only (``check_model``), nothing trained:

    python -m benchmarks.studies.tp_coverage [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZOO = os.path.join(REPO, "tests", "zoo")
PATH = os.path.join(ZOO, "tp_hf.py")


def _sizes() -> dict:
    spec = importlib.util.spec_from_file_location("tp_hf_sizes", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: p.numel() for name, p in module.model().named_parameters()}


def _expert(fqn: str) -> bool:
    return ".experts." in fqn or ".mlp.gate." in fqn or "block_sparse_moe.gate" in fqn


def coverage(family: str, microbatch_size: int, sequence_parallel: bool) -> dict:
    from tracepp.driver import check_model
    from tracepp.runtime.mesh import Layout

    os.environ["TP_HF_FAMILY"] = family
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        manifest = check_model(PATH, num_microbatches=4 // microbatch_size,
                               layout=Layout(pp=2, tp=2, sequence_parallel=sequence_parallel))
        sizes = _sizes()
    layers: dict = {}
    experts = [0, 0]
    for fqn, entry in manifest["tp"]["params"].items():
        match = re.search(r"\.(?:layers|h)\.(\d+)\.", fqn)
        if match is None:
            continue
        if _expert(fqn):
            experts[1] += sizes[fqn]
            experts[0] += sizes[fqn] if entry["dim"] is not None else 0
            continue
        total = layers.setdefault(match.group(1), [0, 0])
        total[1] += sizes[fqn]
        total[0] += sizes[fqn] if entry["dim"] is not None else 0
    shares = {layer: round(sharded / total, 4) for layer, (sharded, total) in sorted(layers.items())}
    replicated = sorted(fqn for fqn, e in manifest["tp"]["params"].items() if e["dim"] is None and fqn in sizes
                        and re.search(r"\.(?:layers|h)\.0\.", fqn) and not _expert(fqn))
    return {"layer_share": shares, "min_share": min(shares.values()), "whole_in_layer_0": replicated,
            "expert_share": round(experts[0] / experts[1], 4) if experts[1] else None,
            "stage_share": [stage["share"] for stage in manifest["tp"]["stages"]]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.tp_coverage")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    args = parser.parse_args(argv)
    sys.path.insert(0, ZOO)
    sys.path.insert(0, REPO)
    from benchmarks import write_result
    from tp_hf import FAMILIES

    record = {"what": "tensor-parallel coverage of tests/zoo/tp_hf.py at tp 2, pp 2, batch 4",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "families": {}}
    for family in FAMILIES:
        for microbatch_size in (1, 2):
            for sequence_parallel in (False, True):
                key = f"{family} mb{microbatch_size}" + (" sp" if sequence_parallel else "")
                try:
                    record["families"][key] = coverage(family, microbatch_size, sequence_parallel)
                except Exception as error:  # a plan that fails is part of the record
                    record["families"][key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                entry = record["families"][key]
                print(f"{key:24s} {entry.get('min_share', entry.get('error'))} experts {entry.get('expert_share')} "
                      f"whole {entry.get('whole_in_layer_0')}", flush=True)
    write_result(args.out, "tensor_parallel_coverage", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
