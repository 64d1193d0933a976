"""Load the user's code at run time: the model file copied into the output folder, and the pytree specs.

The model file may import code beside it (``from nanogpt_model import GPT``, ``from mypkg.model import Net``)
or from the working directory it was split from. ``tracepp split`` records those folders in the manifest
(``import_paths``); they go on ``sys.path`` after the output folder, so a package bundled into the folder
(``tracepp split --bundle PKG``) wins. A recorded folder missing on this machine is only an error when an
import actually fails, and then the message names the folder and the fixes.

A spec that names classes from a library (``transformers.modeling_outputs.CausalLMOutputWithCrossAttentions``)
can only be read once the module defining them registered them with pytree: the manifest lists them
(``spec_types``, ``module:qualname``) and :func:`load_spec` imports each module first.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import torch.utils._pytree as pytree

from .failure import PipelineError


def add_import_paths(manifest: dict, folder: str) -> list:
    """Put the output folder, then the recorded import paths, on ``sys.path``; return those missing here."""
    missing = []
    entries = [os.path.abspath(folder)]
    for path in manifest.get("import_paths", []):
        if os.path.isdir(path):
            entries.append(path)
        else:
            missing.append(path)
    for entry in reversed(entries):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    return missing


def _install_marker_shim() -> None:
    try:
        import tracepp  # noqa: F401  the model file may call tracepp.pipe_split()
    except ImportError:  # tracepp is not installed here: its marker lives in this runtime
        from . import markers

        shim = types.ModuleType("tracepp")
        shim.pipe_split = markers.pipe_split
        sys.modules["tracepp"] = shim


def missing_import_message(manifest: dict, folder: str, missing: list, error: ImportError) -> str:
    name = getattr(error, "name", None) or str(error)
    top = name.split(".")[0]
    paths = ", ".join(repr(p) for p in missing)
    return (f"the model file {manifest.get('model_file', 'model_file.py')!r} failed to import {name!r} "
            f"({type(error).__name__}: {error}); it was split with {paths} on its import path, and that folder "
            f"does not exist on this machine. Fix: copy that folder here at the same path, or set "
            f"PYTHONPATH to where {top!r} lives on this machine, or re-split with "
            f"`tracepp split ... --bundle {top}` so {os.path.basename(os.path.abspath(folder))}/ holds a copy")


def load_user_module(folder: str, manifest: dict = None):
    """Import the model file copied into the output folder (it defines loss_fn, batch, optimizer)."""
    manifest = manifest or {}
    _install_marker_shim()
    missing = add_import_paths(manifest, folder)
    path = os.path.join(folder, "model_file.py")
    spec = importlib.util.spec_from_file_location("tracepp_model_file", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        if missing:
            raise PipelineError(missing_import_message(manifest, folder, missing, error)) from error
        raise
    return module


def import_spec_types(manifest: dict) -> list:
    """Import the module of each class the specs name, so pytree knows how to rebuild them.

    Returns ``[(entry, error)]`` for the modules that failed to import: only an error if a spec then cannot be
    read (a class pytree does not need registered, e.g. a pickled spec's, may live in a module absent here).
    """
    failures = []
    for entry in manifest.get("spec_types", []):
        module_name = entry.split(":")[0]
        if module_name in sys.modules:
            continue
        try:
            importlib.import_module(module_name)
        except ImportError as error:
            failures.append((entry, error))
    return failures


def load_spec(manifest: dict, key: str):
    """A pytree spec from the manifest's ``key``: ``{"json": text}`` where torch can serialise it, else
    ``{"pickle": base64}`` (model-output classes without a serializer)."""
    failures = import_spec_types(manifest)
    spec = manifest.get(key) or {}
    try:
        if spec.get("json"):
            return pytree.treespec_loads(spec["json"])
        if spec.get("pickle"):
            import base64
            import pickle

            return pickle.loads(base64.b64decode(spec["pickle"]))
    except Exception as error:
        if not failures:
            raise
        entry, cause = failures[0]
        raise PipelineError(
            f"the model's inputs or outputs contain {entry.replace(':', '.')}, but importing "
            f"{entry.split(':')[0]!r} failed here ({type(cause).__name__}: {cause}): install the library the model "
            f"uses on this machine (the same version as where it was split), or bundle local code with "
            f"`tracepp split ... --bundle PKG`") from error
    return None
