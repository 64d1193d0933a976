"""Suite-wide setup: split folders shared between tests.

Many tests split the same model file with the same options (a folder for each schedule, then again for the
resume, the metrics, the error case). ``tracepp.driver.split_model`` is wrapped, before any test module imports
it, so that a split already made in this session is copied instead of traced again: the copy is the same
folder (nothing in it names the folder it was written to; its runtime byte-compiled once), and the manifest
returned is a fresh copy. The key is
everything the split reads: the model file and the Python files beside it (their contents), the options, and
the environment (model files read variables such as ``TP_HF_FAMILY``). ``TRACEPP_TEST_SPLIT_CACHE=0`` turns it
off. A split that raises is never cached, so every error test traces.
"""
import compileall
import copy
import hashlib
import os
import shutil
import tempfile

import tracepp.driver

_ORIGINAL = tracepp.driver.split_model
_CACHE = {}  # key -> (cached folder, manifest)
_ROOT = None


def _sources(model_path: str) -> str:
    folder = os.path.dirname(os.path.abspath(model_path))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as handle:
                digest.update(name.encode() + handle.read())
    return digest.hexdigest()


def _key(model_path: str, args: tuple, kwargs: dict) -> str:
    environment = sorted((k, v) for k, v in os.environ.items() if not k.startswith("PYTEST_"))
    text = repr((os.path.abspath(model_path), _sources(model_path), args, sorted(kwargs.items()), environment))
    return hashlib.sha256(text.encode()).hexdigest()


def _byte_compile(folder: str) -> None:
    """The folder's runtime and scripts compiled to bytecode once: every rank process of every test that copies the
    folder reads it instead of compiling the runtime's modules again (PYTHONDONTWRITEBYTECODE=1 environments
    never write it themselves). The copy keeps the sources' times, so the bytecode stays valid."""
    compileall.compile_dir(folder, quiet=1)


def split_model(model_path, out_dir, *args, **kwargs):
    """``tracepp.driver.split_model``, or a copy of the same split made earlier in the session into a folder
    that is new (a folder with files in it is split for real: emit's rules for what it replaces apply)."""
    global _ROOT
    fresh = not os.path.exists(out_dir) or not os.listdir(out_dir)
    if os.environ.get("TRACEPP_TEST_SPLIT_CACHE", "1") == "0" or not fresh:
        return _ORIGINAL(model_path, out_dir, *args, **kwargs)
    key = _key(model_path, args, kwargs)
    if key in _CACHE:
        cached, manifest = _CACHE[key]
        shutil.copytree(cached, out_dir, dirs_exist_ok=True)
        return copy.deepcopy(manifest)
    manifest = _ORIGINAL(model_path, out_dir, *args, **kwargs)
    _byte_compile(out_dir)
    if _ROOT is None:
        _ROOT = tempfile.mkdtemp(prefix="tracepp_split_cache_")
    cached = os.path.join(_ROOT, key)
    shutil.copytree(out_dir, cached)
    _CACHE[key] = (cached, copy.deepcopy(manifest))
    return manifest


split_model.__doc__ = _ORIGINAL.__doc__
tracepp.driver.split_model = split_model


def pytest_sessionfinish(session, exitstatus):
    if _ROOT is not None:
        shutil.rmtree(_ROOT, ignore_errors=True)
