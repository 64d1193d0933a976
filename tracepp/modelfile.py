"""Load a user's model file and check it follows the contract (docs/guide.md, "Writing a model file").

Required: ``model()`` and ``example_inputs()``. Optional: ``example_kwargs()``, ``example_target()``,
``loss_fn(output, target)``, ``split_points``, ``dynamic_shapes``, ``batch_dim``, ``batch(step)``,
``optimizer(params)``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional


class ModelFileError(ValueError):
    """The model file is missing, does not import, or breaks the contract."""


@dataclass
class ModelFile:
    path: str
    module: ModuleType
    sha256: str

    @property
    def training(self) -> bool:
        return hasattr(self.module, "loss_fn")

    def model(self):
        import torch

        built = self.module.model()
        if not isinstance(built, torch.nn.Module):
            raise ModelFileError(f"{self.path}: model() returned {type(built).__name__}, expected a torch.nn.Module")
        return built

    def example_inputs(self) -> tuple:
        args = self.module.example_inputs()
        if not isinstance(args, tuple):
            args = (args,)
        return args

    def example_kwargs(self) -> dict:
        fn = getattr(self.module, "example_kwargs", None)
        kwargs = fn() if fn is not None else {}
        if not isinstance(kwargs, dict):
            raise ModelFileError(f"{self.path}: example_kwargs() must return a dict, got {type(kwargs).__name__}")
        return kwargs

    def example_target(self):
        return self.module.example_target()

    @property
    def split_points(self) -> Optional[list]:
        points = getattr(self.module, "split_points", None)
        return list(points) if points is not None else None

    @property
    def tp_plan(self) -> Optional[dict]:
        """FQN pattern (fnmatch) -> "colwise" | "rowwise" | "replicate": overrides of the tensor-parallel plan."""
        plan = getattr(self.module, "tp_plan", None)
        return dict(plan) if plan is not None else None

    @property
    def dynamic_shapes(self) -> Any:
        return getattr(self.module, "dynamic_shapes", None)

    @property
    def batch_dim(self) -> int:
        """The dim of every batched input, and of the target, that holds the samples: 0, or 1 for a
        sequence-first layout (``[seq, batch]``: ``nn.Transformer``'s and ``nn.LSTM``'s default)."""
        dim = getattr(self.module, "batch_dim", 0)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ModelFileError(f"{self.path}: batch_dim = {dim!r}: give the dim that holds the samples in every "
                                 f"batched input and the target, a non-negative int (0, or 1 for [seq, batch])")
        return dim


def load_model_file(path: str) -> ModelFile:
    """Import ``path`` as a module and check the required names are there."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"model file {path!r} not found: pass the path of a Python file that defines model() and example_inputs()")
    with open(path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    name = "tracepp_user_model_" + digest[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # its own code (a module or package beside it, or in the working directory) stays importable while
    # tracing; the run time puts the same folders on its path (manifest "import_paths")
    for folder in (os.getcwd(), os.path.dirname(path)):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's code failed: say where, keep the cause
        raise ModelFileError(f"importing model file {path!r} failed: {type(error).__name__}: {error}") from error
    missing = [fn for fn in ("model", "example_inputs") if not callable(getattr(module, fn, None))]
    if missing:
        raise ModelFileError(
            f"model file {path!r} must define {' and '.join(f'{m}()' for m in missing)}: "
            "model() returns the nn.Module, example_inputs() returns the positional args of one full batch (a tuple)"
        )
    if callable(getattr(module, "loss_fn", None)) and not callable(getattr(module, "example_target", None)):
        raise ModelFileError(
            f"model file {path!r} defines loss_fn but not example_target(): add example_target() returning the "
            "target of the example batch, or remove loss_fn for a forward-only pipeline"
        )
    return ModelFile(path=path, module=module, sha256=digest)


def bundle_packages(out_dir: str, names: list, search_paths: list) -> list:
    """Copy the named local packages or modules (found in ``search_paths``) into ``out_dir``; return the copies.

    ``tracepp split --bundle PKG`` uses it so the output folder runs on a node without the model's source tree.
    """
    import shutil

    copied = []
    for name in names:
        top = name.split(".")[0]
        for folder in search_paths:
            package, module = os.path.join(folder, top), os.path.join(folder, top + ".py")
            if os.path.isfile(os.path.join(package, "__init__.py")) or (
                    os.path.isdir(package) and not os.path.isfile(module)):
                target = os.path.join(out_dir, top)
                shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                                dirs_exist_ok=True)
                copied.append(target)
                break
            if os.path.isfile(module):
                target = os.path.join(out_dir, top + ".py")
                shutil.copyfile(module, target)
                copied.append(target)
                break
        else:
            raise ModelFileError(
                f"--bundle {name}: no package or module {top!r} in {', '.join(search_paths)}; --bundle takes "
                f"the import name of local code the model file imports (e.g. --bundle mypkg for `from mypkg.model "
                f"import Net`, --bundle nanogpt_model for `from nanogpt_model import GPT`)")
    return copied
