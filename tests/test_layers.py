"""The dependency direction of docs/design.md, checked on every import of the source tree (tier 1, no torch):
runtime < split < codegen < costs < report < core. A module may import its own layer and the layers below it,
never one above (so nothing imports across in both directions)."""
import ast
import os

from util import REPO

LAYERS = ["runtime", "split", "codegen", "costs", "report", "core"]
FOLDERS = {"runtime": "runtime", "split": "split", "codegen": "codegen", "tracepp/costs": "costs",
           "tracepp/report": "report", "tracepp": "core"}


def _layer_of_module(name: str):
    """tracepp.costs.search -> costs; tracepp.driver -> core; torch -> None (outside)."""
    parts = name.split(".")
    if parts[0] != "tracepp":
        return None
    if len(parts) == 1:  # the package itself: pipe_split and __version__, from the runtime (checked below)
        return "runtime"
    return {"runtime": "runtime", "split": "split", "codegen": "codegen", "costs": "costs",
            "report": "report"}.get(parts[1], "core")


def _source_files():
    for folder, layer in FOLDERS.items():
        root = os.path.join(REPO, folder)
        for name in sorted(os.listdir(root)):
            if name.endswith(".py"):
                yield os.path.join(root, name), layer, folder


def _imports(path: str, folder: str):
    package = {"runtime": "tracepp.runtime", "split": "tracepp.split", "codegen": "tracepp.codegen"}.get(
        folder, folder.replace("/", "."))
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within the module's own package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield module, node.lineno
            for alias in node.names:  # from tracepp.costs import search
                yield f"{module}.{alias.name}", node.lineno


def test_imports_follow_the_layers():
    wrong = []
    for path, layer, folder in _source_files():
        for module, line in _imports(path, folder):
            target = _layer_of_module(module)
            if target is not None and LAYERS.index(target) > LAYERS.index(layer):
                wrong.append(f"{os.path.relpath(path, REPO)}:{line} ({layer}) imports {module} ({target})")
    assert not wrong, "imports against the direction " + " < ".join(LAYERS) + ":\n" + "\n".join(wrong)


def test_the_package_itself_exports_only_the_runtime_marker():
    init = os.path.join(REPO, "tracepp", "__init__.py")
    layers = {_layer_of_module(module) for module, _line in _imports(init, "tracepp")} - {None}
    assert layers <= {"runtime"}, layers


def test_the_check_sees_an_upward_import(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from tracepp.costs.search import tune\n")
    found = [(module, _layer_of_module(module)) for module, _line in _imports(str(path), "split")]
    assert ("tracepp.costs.search", "costs") in found
