"""How a folder was split, recorded in its manifest (``split_options``), and splitting it again with some
choices changed (``tracepp plan --tune --apply``)."""
from __future__ import annotations

import dataclasses
import os

from tracepp.dynamic import DynamicFlags


def split_options(model_path: str, layout, num_stages, schedule: str, num_microbatches: int, split_points,
                  dynamic_shapes, graph=None, run=None) -> dict:
    """What ``split_model`` was called with, as JSON (the manifest's ``split_options``): enough to split again
    with some choices changed (:func:`resplit`). ``stage_begins``: the module each stage after the first begins
    at, where the segment table names it."""
    dynamic = None
    if isinstance(dynamic_shapes, DynamicFlags):
        dynamic = {"flags": dataclasses.asdict(dynamic_shapes)}
    elif dynamic_shapes is not None:
        dynamic = {"unrecorded": True}  # a dynamic_shapes object we cannot write down
    begins = None
    if graph is not None and graph.segments:
        firsts: dict = {}
        for segment in graph.segments:
            firsts.setdefault(segment.get("stage"), segment.get("begins"))
        begins = [firsts.get(stage) for stage in range(1, graph.num_stages)]
        if any(b is None for b in begins):
            begins = None
    return {"model": os.path.abspath(model_path), "layout": dataclasses.asdict(layout), "num_stages": num_stages,
            "schedule": str(schedule), "num_microbatches": num_microbatches,
            "split_points": split_points if split_points is None or isinstance(split_points, str) else list(split_points),
            "dynamic": dynamic, "stage_begins": begins, "run_options": run.to_json() if run is not None else None}


def recorded_layout(options: dict):
    """The :class:`~tracepp.runtime.mesh.Layout` a manifest's ``split_options`` record (older manifests wrote
    its fields one by one)."""
    from tracepp.runtime.mesh import Layout

    if "layout" in options:
        return Layout(**options["layout"])
    return Layout(pp=options["num_ranks"], dp=options.get("dp", 1), dp_mode=options.get("dp_mode", "fsdp"),
                  dp_shard=options.get("dp_shard"), dp_order=options.get("dp_order", "pp-inner"),
                  tp=options.get("tp", 1))


def recorded_call(manifest: dict, out_dir: str, **changes) -> tuple:
    """(model path, ``split_model``'s keyword arguments) as the manifest's ``split_options`` record them, with
    ``changes`` (see :func:`resplit`); the model file is the recorded path, else the folder's own copy
    ``model_file.py``."""
    options = dict(manifest.get("split_options") or {})
    if not options:
        raise ValueError("this folder's manifest does not record how it was split (made by an older tracepp): run "
                         "`tracepp split` again with the chosen options")
    from tracepp.runtime.run_options import RunOptions

    layout = recorded_layout(options).replace(**changes.pop("layout", {}))
    # what was asked (``auto`` checkpointing is chosen again for the new plan), else what was planned
    run = RunOptions.from_json(options.get("requested_run_options") or options.get("run_options")).replace(
        **changes.pop("run", {}))
    options.update(changes)
    model_path = options["model"]
    if not os.path.isfile(model_path):
        model_path = os.path.join(manifest.get("_folder", out_dir), "model_file.py")
    dynamic = options.get("dynamic")
    if dynamic and dynamic.get("unrecorded"):
        raise ValueError("this folder was split with dynamic_shapes passed from Python, which the manifest cannot "
                         "record: split again yourself with the chosen options")
    flags = DynamicFlags(**{**dynamic["flags"], "dims": [tuple(d) for d in dynamic["flags"]["dims"]]}) if dynamic else None
    return model_path, dict(num_stages=options["num_stages"], schedule=options["schedule"],
                            num_microbatches=options["num_microbatches"], split_points=options["split_points"],
                            dynamic_shapes=flags, layout=layout, run=run)


def resplit(manifest: dict, out_dir: str, **changes) -> dict:
    """Split again as the manifest's ``split_options`` record, with ``changes`` (e.g. ``schedule``,
    ``num_stages``, ``num_microbatches``, ``split_points``, ``layout`` changes as a dict, e.g. ``{"tp": 2}``, and
    ``run`` changes to the run options, e.g. ``{"activation_checkpointing": "full,none"}``)
    into ``out_dir``; the model file is the recorded path, else the folder's own copy ``model_file.py``."""
    from tracepp.driver import split_model  # the driver imports split_options from here

    model_path, call = recorded_call(manifest, out_dir, **changes)
    return split_model(model_path, out_dir, **call)


def apply_tuned(manifest: dict, out_dir: str, best) -> dict:
    """Split the folder again with ``best``'s schedule, stages, microbatches, split points, tp, sequence
    parallelism, ep and cp (the driver, with the model file and the other options the manifest records)."""
    from tracepp.costs.search import stage_of_segments

    own = stage_of_segments(manifest)
    if own is not None and tuple(own) == best.split:  # the same cuts: as the folder was split (markers included)
        recorded = (manifest.get("split_options") or {}).get("split_points")
        return resplit(manifest, out_dir, schedule=best.schedule, num_stages=best.num_stages,
                       num_microbatches=best.num_microbatches, split_points=recorded,
                       layout={"tp": best.tp, "sequence_parallel": best.sequence_parallel, "ep": best.ep,
                               "cp": best.cp},
                       run={"activation_checkpointing": best.checkpointing})
    return resplit(manifest, out_dir, schedule=best.schedule, num_stages=best.num_stages,
                   num_microbatches=best.num_microbatches, split_points=list(best.split_points),
                   layout={"tp": best.tp, "sequence_parallel": best.sequence_parallel, "ep": best.ep,
                               "cp": best.cp},
                   run={"activation_checkpointing": best.checkpointing})
