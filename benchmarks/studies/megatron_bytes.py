"""Each family's ``--tp 2`` traffic beside Megatron's plan for the same layers (issue 57's goal: at most 1.0x where
Megatron's plan applies), for every model of the two family tables (``docs/families.md``): transformers' causal-LM
families (``tests/zoo/hf_family.py``) and the decoder code of other libraries (``tests/zoo_other``).

For each model, in its own process with a time limit: ``tracepp check --ranks 2 --tp 2`` (2 microbatches of 2
samples, no verification: the plan is what is measured), then from the manifest each decoder layer's bytes per
microbatch (``split.plan_cost``: forward and backward, as ring collectives move them) and Megatron's for that layer
(an all-reduce of its ``[b, s, h]`` after the attention and after the MLP, forward and backward), where that plan
applies (a layer with an attention and at least as many key/value groups as tp). The worst layer's ratio is kept::

    nice -n 10 python -m benchmarks.studies.megatron_bytes [--models llama,nanogpt] [--timeout 300] [--in-process]

``--in-process`` plans every model in this one process (about 1 s a model where a process of its own costs 15 s:
the imports and the model file's load are paid once; a per-model alarm stands for the time limit, and a crash of
the interpreter stops the run where the file written so far ends).

writes ``benchmarks/results/<time>_megatron_bytes.json`` and prints a table (families over 1.0x, and how many
layers have no Megatron plan to compare with, by reason).

``--compare BEFORE.json [AFTER.json ...]`` plans nothing: it reads earlier results (the after files merged, by
model) and prints every model whose layers' bytes, Megatron figures or stage shares changed, the before/after check
of a change to the planner::

    python -m benchmarks.studies.megatron_bytes --compare benchmarks/results/20261130-232738_megatron_bytes.json \
        benchmarks/results/20261201-044836_megatron_bytes.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

_ONE = r"""
import json, os, sys
sys.path[:0] = [{zoo!r}, {tests!r}]
from tracepp.driver import check_model
from tracepp.runtime.mesh import Layout
manifest = check_model({path!r}, num_microbatches=2, layout=Layout(pp=2, tp=2), verify="off")
print("RESULT " + json.dumps(manifest["tp"]["stages"]))
"""


def models() -> list:
    """(name, model file, environment) for every family of both tables."""
    from benchmarks.studies import families, other_families

    out = [(name, families.PATH, {"HF_FAMILY": name}) for name in families.families()]
    out += [(name, other_families.path_of(name), {}) for name in other_families.models()]
    return out


def _record(name: str, stages: list, started: float) -> dict:
    """A model's record from its manifest's tp stages: each layer's bytes beside Megatron's, a layer on two stages
    (or applied on both: Megatron's figure counts each stage's calls of it) summed."""
    layers: dict = {}
    for stage in stages:
        for layer, (moved, megatron) in stage.get("layers", {}).items():
            before = layers.get(layer, (0, None))
            summed = before[1] if megatron is None else megatron + (before[1] or 0)
            layers[layer] = (before[0] + moved, summed)
    ratios = [moved / megatron for moved, megatron in layers.values() if megatron]
    return {"model": name, "seconds": round(time.time() - started, 1), "layers": layers,
            "share": [stage["share"]["params"] for stage in stages], "worst": max(ratios) if ratios else None,
            "compared": len(ratios), "not_compared": len(layers) - len(ratios)}


def measure_here(name: str, path: str, env: dict, timeout: float) -> dict:
    """:func:`measure` in this process (``--in-process``): the same check, the model file loaded with ``env`` set."""
    import signal

    from tracepp.driver import check_model
    from tracepp.runtime.mesh import Layout

    def expired(*_args):
        raise TimeoutError(f"over {timeout:.0f} s")

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    for folder in (os.path.dirname(path), os.path.join(REPO, "tests")):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    started = time.time()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(int(timeout))
    try:
        manifest = check_model(path, num_microbatches=2, layout=Layout(pp=2, tp=2), verify="off")
    except BaseException as error:  # noqa: BLE001 (a model that fails is recorded, the run goes on)
        if isinstance(error, KeyboardInterrupt):
            raise
        return {"model": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return _record(name, manifest["tp"]["stages"], started)


def measure(name: str, path: str, env: dict, timeout: float) -> dict:
    code = _ONE.format(zoo=os.path.dirname(path), tests=os.path.join(REPO, "tests"), path=path)
    started = time.time()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **env), cwd="/tmp")
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"over {timeout:.0f} s"}
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": name, "error": tail[:300]}
    return _record(name, json.loads(line[len("RESULT "):]), started)


def compare(before: str, after: list) -> list:
    """Lines naming each model planned in both whose layers (bytes, Megatron's figure), shares, worst ratio or error
    differ between ``before`` and ``after`` (files merged in order), and a count."""
    def records(path):
        with open(path) as handle:
            return {r["model"]: r for r in json.load(handle)["records"]}

    old, new = records(before), {}
    for path in after:
        new.update(records(path))
    lines, same = [], 0
    for name in sorted(set(old) & set(new)):
        facts = [(r.get("layers"), r.get("share"), r.get("worst"), re.sub(r"\S*/site-packages/", "", r.get("error", ""))[:80])
                 for r in (old[name], new[name])]  # an error's library path is the machine's, not the plan's
        if facts[0] == facts[1]:
            same += 1
            continue
        (layers0, share0, worst0, error0), (layers1, share1, worst1, error1) = facts
        lines.append(f"{name}: shares {share0} -> {share1}; worst {worst0} -> {worst1}"
                     + (f"; error {error0!r} -> {error1!r}" if error0 != error1 else "")
                     + "".join(f"\n  {layer}: {(layers0 or {}).get(layer)} -> {(layers1 or {}).get(layer)}"
                               for layer in sorted(set(layers0 or {}) | set(layers1 or {}))
                               if (layers0 or {}).get(layer) != (layers1 or {}).get(layer)))
    lines.append(f"{same} of {len(set(old) & set(new))} models planned in both unchanged; {len(lines)} changed; "
                 f"{len(set(new) - set(old))} new, {len(set(old) - set(new))} not planned again")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated names (default: every family)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--in-process", action="store_true", help="every model in this process (module docstring)")
    parser.add_argument("--compare", nargs="+", default=None, metavar="RESULTS",
                        help="compare results files: the first before, the rest after (module docstring)")
    args = parser.parse_args(argv)
    if args.compare:
        print("\n".join(compare(args.compare[0], args.compare[1:])))
        return 0
    chosen = models()
    if args.models:
        wanted = set(args.models.split(","))
        chosen = [m for m in chosen if m[0] in wanted]
    records = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(REPO, "benchmarks", "results", f"{stamp}_megatron_bytes.json")
    for name, path, env in chosen:
        record = (measure_here if args.in_process else measure)(name, path, env, args.timeout)
        records.append(record)
        worst = record.get("worst")
        print(f"{name}: " + (record["error"] if "error" in record else
                             f"worst layer {worst:.2f}x Megatron" if worst is not None else
                             f"no layer with a Megatron plan ({record['not_compared']} layers)"), flush=True)
        with open(out, "w") as handle:  # after every model: a stopped run keeps what it measured
            json.dump({"what": "tp 2 bytes per microbatch per decoder layer beside Megatron's plan",
                       "models": len(chosen), "in_process": args.in_process, "records": records}, handle, indent=1)
    compared = [r for r in records if r.get("worst") is not None]
    over = sorted((r for r in compared if r["worst"] > 1.0 + 1e-9), key=lambda r: -r["worst"])
    print(f"\n{len(compared)} models with a layer Megatron's plan applies to; {len(compared) - len(over)} at or under "
          f"1.0x; over: " + (", ".join(f"{r['model']} {r['worst']:.2f}x" for r in over) or "none"))
    print(f"no comparable layer: {', '.join(r['model'] for r in records if r.get('worst') is None and 'error' not in r)}")
    print(f"errors: {', '.join(r['model'] for r in records if 'error' in r) or 'none'}")
    print(f"results: {os.path.relpath(out, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
