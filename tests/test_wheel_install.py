"""A wheel install (not editable) of tracepp: the package-dir mapping (split/ -> tracepp.split, codegen/ ->
tracepp.codegen, runtime/ -> tracepp.runtime) must ship every module, and a folder split by the installed
package must run. Builds the wheel with pip (build isolation, as a user's `pip install .` would).

The wheel goes into a new virtual environment that sees the packages of the interpreter running the suite (torch
and the rest), whether that interpreter is the machine's own Python or itself a virtual environment: a venv made
with ``--system-site-packages`` would see the *base* interpreter's packages instead, which lack torch when the
suite runs in a venv."""
import os
import subprocess
import sys
import zipfile

import pytest

from util import REPO, model_path


def _site_packages_of_this_interpreter() -> list:
    """The site-packages folders the running interpreter imports from (a venv's own, and the base's when that
    venv was made with --system-site-packages): never the source tree, which an editable install reaches through
    a finder that only a processed .pth file installs."""
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


def _see_running_packages(python: str) -> None:
    """Put the running interpreter's site-packages on the new venv's path, after its own (a .pth of plain folder
    lines: the folders' own .pth files, such as an editable install's finder, are not run)."""
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    folders = _site_packages_of_this_interpreter()
    assert folders, f"no site-packages on this interpreter's sys.path: {sys.path}"
    with open(os.path.join(purelib, "_tracepp_suite_packages.pth"), "w") as handle:
        handle.write("\n".join(folders) + "\n")


@pytest.mark.timeout(400)
def test_wheel_installs_splits_and_runs(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), REPO],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = list(wheels.glob("tracepp-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("split", "codegen", "runtime"):
        sources = {n for n in os.listdir(os.path.join(REPO, folder)) if n.endswith(".py")}
        shipped = {n.split("/")[-1] for n in names if n.startswith(f"tracepp/{folder}/")}
        assert sources <= shipped, f"tracepp/{folder}/ in the wheel lacks {sorted(sources - shipped)}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    _see_running_packages(python)
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"  # not the repository: nothing may be imported from the source tree
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import tracepp.split.partition, tracepp.codegen.emit, tracepp.runtime."
                            "pipeline as p; print(p.__file__)"], capture_output=True, text=True, cwd=elsewhere,
                           env=env, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert str(venv) in where.stdout and REPO not in where.stdout, where.stdout
    split = subprocess.run([python, "-m", "tracepp", "split", model_path("residual_mlp_lm"), "-o", "out",
                            "--ranks", "1", "--stages", "2", "--schedule", "looped-bfs", "--microbatches", "2"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, timeout=200)
    assert split.returncode == 0, split.stderr[-3000:]
    run = subprocess.run([python, os.path.join("out", "run.py"), "--steps", "2"], capture_output=True, text=True,
                         cwd=elsewhere, env=env, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2/2" in run.stdout
