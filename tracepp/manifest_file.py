"""Read an output folder's ``manifest.json`` (the plan's record for tools) and the data tools derive from it."""
from __future__ import annotations

import json
import os

from tracepp.codegen.actions import Topology


def load_manifest(out_dir: str) -> dict:
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: pass a folder written by `tracepp split`")
    with open(path) as handle:
        manifest = json.load(handle)
    manifest["_folder"] = out_dir
    return manifest


def topology_from_manifest(manifest: dict) -> Topology:
    return Topology.from_values(len(manifest["stages"]), ((v["producer"], v["consumers"], v["requires_grad"])
                                                          for v in manifest["values"].values()))
