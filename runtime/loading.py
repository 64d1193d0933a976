"""Read what an output folder holds: the manifest, pytree specs, the copied model file and the rank scripts.

Plain loading, no training: the pipeline, the training loop and the benchmarks all read a folder this way.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import types

import torch.utils._pytree as pytree


def load_manifest(folder: str) -> dict:
    with open(os.path.join(folder, "manifest.json")) as handle:
        return json.load(handle)


def load_spec(manifest: dict, key: str):
    """A pytree spec from the manifest: JSON where torch can serialise it, else a pickle (model-output classes)."""
    if manifest.get(key):
        return pytree.treespec_loads(manifest[key])
    if manifest.get(key + "_pickle"):
        import base64
        import pickle

        return pickle.loads(base64.b64decode(manifest[key + "_pickle"]))
    return None


def load_user_module(folder: str):
    """Import the model file copied into the output folder (it defines loss_fn, batch, optimizer)."""
    try:
        import tracepp  # noqa: F401  the model file may call tracepp.pipe_split()
    except ImportError:  # tracepp is not installed here: its marker lives in this runtime
        from . import markers

        shim = types.ModuleType("tracepp")
        shim.pipe_split = markers.pipe_split
        sys.modules["tracepp"] = shim
    path = os.path.join(folder, "model_file.py")
    spec = importlib.util.spec_from_file_location("tracepp_model_file", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


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
