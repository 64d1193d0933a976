"""The figures ``plan --tune`` prices other layouts from, computed when the tuner first asks for them and cached
in the folder's manifest.

A split does not compute them: each walks the whole traced graph (tensor parallelism once per tp size, with and
without sequence parallelism; context parallelism; the routed experts), which is minutes on a 671B model, and
most splits are never tuned. ``plan --tune --tp-sizes 1,2,4`` (``--cp-sizes``, ``--ep-sizes``) finds the ones it
needs missing, traces and splits the model again as the manifest records it, computes exactly those
(``split.partition.tuner_figures``), merges them into the manifest's segment table (``segments[k]["tp"]``,
``["cp"]``, ``["ep"]``) and records what was computed (``manifest["tuner_figures"]``), so the next tune reads them.
"""
from __future__ import annotations

import json
import os
import time

from tracepp import phases


MODES = ("none", "selective", "full")


def computed(manifest: dict) -> dict:
    """What the manifest holds: {"tp": [sizes], "cp": bool, "ep": bool, "memory": bool}. A folder split by a
    tracepp that computed them at every split has them in its segments without the record."""
    segments = manifest.get("segments") or []
    memory = bool(segments) and all(set(MODES) <= set(seg.get("memory") or {}) for seg in segments)
    record = manifest.get("tuner_figures")
    if record is not None:
        return {"tp": sorted(record.get("tp", [])), "cp": bool(record.get("cp")), "ep": bool(record.get("ep")),
                "memory": memory}
    sizes = set.intersection(*[{int(k) for k in (seg.get("tp") or {})} for seg in segments]) if segments else set()
    return {"tp": sorted(sizes), "cp": any("cp" in seg for seg in segments),
            "ep": any("ep" in seg for seg in segments), "memory": memory}


def missing(manifest: dict, tp_sizes=None, cp_sizes=None, ep_sizes=None, memory_limit=None) -> dict:
    """What a tune with these sizes needs that the manifest lacks: {"tp": [sizes], "cp": bool, "ep": bool,
    "memory": bool} (``memory``: with a ``memory_limit``, each segment's kept bytes and temporaries under every
    checkpointing mode, which the tuner chooses each plan's checkpointing from; a forward-only folder has none)."""
    have = computed(manifest)
    tp = sorted({t for t in (tp_sizes or []) if t > 1} - set(have["tp"]))
    cp = any(c > 1 for c in (cp_sizes or [])) and not have["cp"]
    ep = any(e > 1 for e in (ep_sizes or [])) and not have["ep"]
    memory = (memory_limit is not None and bool(manifest.get("training", True)) and not have["memory"]
              and bool(manifest.get("memory")))
    return {"tp": tp, "cp": cp, "ep": ep, "memory": memory}


def ensure(manifest: dict, folder: str, tp_sizes=None, cp_sizes=None, ep_sizes=None, memory_limit=None,
           say=print) -> dict:
    """The manifest with every figure a tune with these sizes (and ``memory_limit``) needs: computed now where
    missing, written back to ``folder/manifest.json``. Returns the (updated) manifest."""
    wanted = missing(manifest, tp_sizes, cp_sizes, ep_sizes, memory_limit)
    if not any(wanted.values()):
        return manifest
    from tracepp.driver import _plan, trace_and_split
    from tracepp.resplit import recorded_call
    from tracepp.split.partition import tuner_figures

    what = ", ".join(([f"tp {','.join(map(str, wanted['tp']))}"] if wanted["tp"] else [])
                     + [kind for kind in ("cp", "ep") if wanted[kind]]
                     + (["memory under every checkpointing mode"] if wanted["memory"] else []))
    say(f"computing the tuner's figures for {what} (once; cached in {os.path.join(folder, 'manifest.json')})")
    started = time.perf_counter()
    model_path, call = recorded_call(manifest, folder)
    from tracepp.runtime.run_options import manifest_options

    dtype = manifest_options(manifest).traced_dtype()
    if wanted["memory"]:  # the folder's whole plan again, every stage counted under every mode
        model_file, _traced, graph, _plan_json, _run = _plan(model_path, call["layout"], call["num_stages"],
                                                             call["schedule"], call["num_microbatches"],
                                                             call["split_points"], call["dynamic_shapes"],
                                                             call["run"], all_modes=True)
    else:
        model_file, _traced, graph = trace_and_split(model_path, call["layout"], call["num_stages"],
                                                     call["schedule"], call["num_microbatches"],
                                                     call["split_points"], call["dynamic_shapes"], dtype)
    if manifest.get("model_sha256") and model_file.sha256 != manifest["model_sha256"]:
        raise ValueError(f"{model_path} changed since {folder} was split (its sha256 differs from the manifest's): "
                         f"split again, then tune")
    with phases.step("tuner figures"):
        segments = tuner_figures(graph, wanted["tp"], wanted["cp"], wanted["ep"])
    old = manifest.get("segments") or []
    if [s.get("begins") for s in segments] != [s.get("begins") for s in old]:
        raise ValueError(f"the segment table of {model_path} traced now differs from the one in {folder}: split "
                         f"again, then tune")
    for mine, new, counted in zip(old, segments, graph.segments):
        if wanted["tp"] and "tp" in new:
            mine.setdefault("tp", {}).update(new["tp"])
        for kind in ("cp", "ep"):
            if wanted[kind] and kind in new:
                mine[kind] = new[kind]
        if wanted["memory"] and "memory" in counted:
            mine["memory"] = counted["memory"]
    have = computed(manifest)
    manifest["tuner_figures"] = {"tp": sorted(set(have["tp"]) | set(wanted["tp"])), "cp": have["cp"] or wanted["cp"],
                                 "ep": have["ep"] or wanted["ep"]}
    _write(manifest, folder)
    say(f"computed in {time.perf_counter() - started:.1f} s")
    return manifest


def _write(manifest: dict, folder: str) -> None:
    """manifest.json rewritten whole, atomically (a crash leaves the old one)."""
    path = os.path.join(folder, "manifest.json")
    data = {k: v for k, v in manifest.items() if not k.startswith("_")}
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(tmp, path)


def segments_with_figures(model_path: str, tp_sizes=(2, 4, 8), cp: bool = False, ep: bool = False,
                          num_stages=None, schedule: str = "1f1b", num_microbatches: int = 4, split_points=None,
                          dynamic_shapes=None, layout=None) -> list:
    """The segment table of ``model_path`` split as ``tracepp split`` would (``layout``: its dp decides the traced
    microbatch), with the tuner's figures for ``tp_sizes``, ``cp`` and ``ep``: what a folder's manifest holds once
    ``plan --tune`` has asked for them."""
    from tracepp.driver import trace_and_split
    from tracepp.runtime.mesh import Layout
    from tracepp.split.partition import tuner_figures

    layout = layout or Layout(pp=2)
    _model_file, _traced, graph = trace_and_split(model_path, layout, num_stages, schedule, num_microbatches,
                                                  split_points, dynamic_shapes)
    return tuner_figures(graph, tuple(tp_sizes), cp, ep)
