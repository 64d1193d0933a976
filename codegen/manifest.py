"""Read an output folder's ``manifest.json`` (the plan's record for tools) and the data tools derive from it."""
from __future__ import annotations

import json
import os

from tracepp.runtime.actions import Topology
from tracepp.runtime.failure import PipelineError
from tracepp.runtime.loading import check_format


def load_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: pass a folder written by `tracepp split`")
    with open(path) as handle:
        manifest = json.load(handle)
    try:
        check_format(manifest, path)
    except PipelineError as error:  # the CLI reports ValueErrors in one line
        raise ValueError(str(error)) from None
    manifest["_folder"] = out_dir
    return manifest


def topology_from_manifest(manifest: dict) -> Topology:
    return Topology.from_manifest(manifest)
