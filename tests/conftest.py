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


# -- the suite's size: process launches and seconds per test (issue 60) -------------------------------------------
# Every Python process a test starts (a rank, torchrun's agent, the CLI) is counted, per test; with
# TRACEPP_TIMINGS=FILE the session writes per file and per test the seconds and the launches to FILE
# (tests/timings.json is such a file, of the README's command on the 2-core machine: docs/design.md#testing).
# The slower tier (``-m slow``, run by .ci/run after the README's command) is named in tests/slow_tier.txt.
import json
import subprocess
import sys
import time

import pytest

_LAUNCHES = {"count": 0}
_PER_TEST: dict = {}  # nodeid -> [seconds, launches]
_STARTED = time.time()
_popen_init = subprocess.Popen.__init__


def _counting_init(self, args, *rest, **kwargs):
    first = args[0] if isinstance(args, (list, tuple)) and args else args
    name = os.path.basename(str(first))
    if name.startswith("python") or str(first) == sys.executable or name in ("torchrun", "tracepp"):
        _LAUNCHES["count"] += 1
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counting_init


def _slow_tier() -> list:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tier.txt")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [line.split("#")[0].strip() for line in handle if line.split("#")[0].strip()]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slower tier (tests/slow_tier.txt), run by .ci/run with -m slow")


def pytest_collection_modifyitems(config, items):
    slow = _slow_tier()
    for item in items:
        if any(item.nodeid == name or item.nodeid.startswith(name + "[") or item.nodeid.startswith(name + "::")
               for name in slow):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, started = _LAUNCHES["count"], time.perf_counter()
    yield
    _PER_TEST[item.nodeid] = [round(time.perf_counter() - started, 2), _LAUNCHES["count"] - before]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _PER_TEST:
        return
    terminalreporter.write_line(f"tracepp suite: {len(_PER_TEST)} tests, {_LAUNCHES['count']} process launches, "
                                f"{time.time() - _STARTED:.0f} s")
    target = os.environ.get("TRACEPP_TIMINGS")
    if not target:
        return
    files: dict = {}
    for nodeid, (seconds, launches) in _PER_TEST.items():
        entry = files.setdefault(nodeid.split("::")[0], {"tests": 0, "seconds": 0.0, "launches": 0})
        entry["tests"] += 1
        entry["seconds"] = round(entry["seconds"] + seconds, 1)
        entry["launches"] += launches
    import torch

    record = {"written": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "selection": " ".join(config.invocation_params.args), "tests": len(_PER_TEST),
              "seconds": round(time.time() - _STARTED), "launches": _LAUNCHES["count"],
              "files": dict(sorted(files.items(), key=lambda kv: -kv[1]["seconds"])),
              "slowest": sorted(([k, *v] for k, v in _PER_TEST.items()), key=lambda row: -row[1])[:40]}
    with open(target, "w") as handle:
        json.dump(record, handle, indent=1)
