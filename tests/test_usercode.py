"""Tier 1: the runtime loads the model file with its own imports, and names a missing folder only when needed."""
import sys

import pytest

from tracepp.runtime.failure import PipelineError
from tracepp.runtime.usercode import import_spec_types, load_spec, load_user_module


@pytest.fixture(autouse=True)
def _own_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))


def _out_folder(tmp_path, source: str) -> str:
    out = tmp_path / "out"
    out.mkdir()
    (out / "model_file.py").write_text(source)
    return str(out)


def test_package_in_the_split_working_directory_is_importable(tmp_path):
    work = tmp_path / "work"
    (work / "byom_cwd_pkg").mkdir(parents=True)
    (work / "byom_cwd_pkg" / "__init__.py").write_text("VALUE = 42\n")
    out = _out_folder(tmp_path, "from byom_cwd_pkg import VALUE\n")
    module = load_user_module(out, {"import_paths": [str(tmp_path / "elsewhere"), str(work)]})
    assert module.VALUE == 42
    assert sys.path.index(out) < sys.path.index(str(work))  # a bundled copy in out/ wins


def test_missing_folder_that_nothing_needs_is_no_error(tmp_path):
    out = _out_folder(tmp_path, "import json\nVALUE = 1\n")
    assert load_user_module(out, {"import_paths": [str(tmp_path / "gone")]}).VALUE == 1


def test_missing_folder_that_an_import_needs_is_named_with_the_fixes(tmp_path):
    out = _out_folder(tmp_path, "from byom_gone_pkg.model import Net\n")
    gone = str(tmp_path / "gone")
    with pytest.raises(PipelineError) as caught:
        load_user_module(out, {"model_file": "train.py", "import_paths": [gone]})
    assert str(caught.value) == (
        f"the model file 'train.py' failed to import 'byom_gone_pkg' (ModuleNotFoundError: No module named "
        f"'byom_gone_pkg'); it was split with {gone!r} on its import path, and that folder does not exist on this "
        f"machine. Fix: copy that folder here at the same path, or set PYTHONPATH to where 'byom_gone_pkg' lives on "
        f"this machine, or re-split with `tracepp split ... --bundle byom_gone_pkg` so out/ holds a copy")


def test_spec_type_module_is_imported_and_a_missing_library_named_when_needed(tmp_path):
    (tmp_path / "byom_outputs.py").write_text("class Out:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    assert import_spec_types({"spec_types": ["byom_outputs:Out"]}) == []
    assert "byom_outputs" in sys.modules
    manifest = {"spec_types": ["nolib_xyz.modeling:Out"],
                "out_spec": {"json": '[1, {"type": "nolib_xyz.modeling.Out", "context": "null", "children_spec": []}]'}}
    with pytest.raises(PipelineError, match=r"contain nolib_xyz.modeling.Out, but importing 'nolib_xyz.modeling' "
                                            r"failed here .*install the library the model uses"):
        load_spec(manifest, "out_spec")
    assert load_spec({"spec_types": ["nolib_xyz.modeling:Out"]}, "out_spec") is None  # not needed: no error
