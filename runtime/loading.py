"""Read what an output folder holds: the manifest and the rank scripts (the model file and the pytree specs:
``usercode``, re-exported here).

Plain loading, no training: the pipeline, the training loop and the benchmarks all read a folder this way.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

from .failure import PipelineError
from .usercode import load_spec, load_user_module  # noqa: F401  (the folder's user code)

# The manifest layout this runtime reads; ``tracepp split`` writes it, and bumps it when the layout changes.
MANIFEST_FORMAT = 2


def check_format(manifest: dict, path: str) -> None:
    found = manifest.get("format")
    if found != MANIFEST_FORMAT:
        raise PipelineError(f"{path} has manifest format {found}, but this tracepp reads format {MANIFEST_FORMAT}: "
                            f"re-run `tracepp split` to write the folder again")


def load_manifest(folder: str) -> dict:
    path = os.path.join(folder, "manifest.json")
    with open(path) as handle:
        manifest = json.load(handle)
    check_format(manifest, path)
    return manifest


def load_rank_script(folder: str, rank: int):
    """Import ``rank{rank}.py`` as a module (its ``__main__`` block does not run): its STAGE_FUNCTIONS,
    ACTIONS and boundary_shapes are the program of that rank."""
    path = os.path.join(os.path.abspath(folder), f"rank{rank}.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: is {folder!r} a tracepp output folder?")
    spec = importlib.util.spec_from_file_location(f"tracepp_rank{rank}_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.abspath(folder))  # the script imports tracepp_runtime from its folder
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module
