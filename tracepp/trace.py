"""Step 1, trace: run ``torch.export`` on the whole model with one microbatch of the example batch.

Returns a :class:`Traced` record: the ExportedProgram, the model (for parameter aliases), and how the
example batch maps onto the program's inputs. Export failures are re-raised as :class:`TraceError` in the
user's terms: the module and source line that broke the graph, and what to try.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from tracepp.modelfile import ModelFile, ModelFileError


class TraceError(ValueError):
    """torch.export could not capture the model."""


@dataclass
class Traced:
    program: torch.export.ExportedProgram
    model: torch.nn.Module
    model_file: ModelFile
    num_microbatches: int
    batch_size: int  # of the full example batch
    batched_leaves: list  # per flattened (args, kwargs) leaf: is it chunked along dim 0?
    example_leaves: list = field(default_factory=list)  # flattened full example batch


def batch_size_of(leaves: list, where: str) -> int:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ModelFileError(f"{where}: no tensor input with a batch dimension (dim 0) to split into microbatches")


def first_microbatch(leaves: list, batched: list, batch_size: int, num_microbatches: int) -> list:
    """Slice microbatch 0 (the size ``torch.tensor_split`` gives it) from every batched leaf."""
    size = -(-batch_size // num_microbatches)
    return [leaf[:size] if is_batched else leaf for leaf, is_batched in zip(leaves, batched)]


def trace(model_file: ModelFile, num_microbatches: int, dynamic_shapes: Any = None) -> Traced:
    model = model_file.model()
    args, kwargs = model_file.example_inputs(), model_file.example_kwargs()
    leaves, spec = pytree.tree_flatten((args, kwargs))
    batch_size = batch_size_of(leaves, f"{model_file.path}: example_inputs()")
    if num_microbatches < 1 or num_microbatches > batch_size:
        raise ValueError(
            f"--microbatches {num_microbatches} does not fit the example batch of {batch_size} samples: "
            f"choose 1..{batch_size}"
        )
    if dynamic_shapes is None and batch_size % num_microbatches:
        raise ValueError(
            f"the example batch has {batch_size} samples, which {num_microbatches} microbatches do not divide: "
            f"choose a divisor of {batch_size} or declare a dynamic batch dimension"
        )
    batched = [isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch_size for leaf in leaves]
    mb_args, mb_kwargs = pytree.tree_unflatten(first_microbatch(leaves, batched, batch_size, num_microbatches), spec)
    if dynamic_shapes is None:
        dynamic_shapes = model_file.dynamic_shapes
    try:
        program = torch.export.export(model, tuple(mb_args), dict(mb_kwargs), dynamic_shapes=dynamic_shapes)
    except Exception as error:
        raise TraceError(explain_export_failure(error, model, model_file.path)) from error
    return Traced(program, model, model_file, num_microbatches, batch_size, batched, leaves)


def _failure_site(error: BaseException, model: torch.nn.Module, model_path: str):
    """The deepest frame of the failing call that belongs to the user's code, and the module running it."""
    names = {id(module): name or "<root>" for name, module in model.named_modules()}
    torch_dir = os.path.dirname(torch.__file__)
    site, module_name = None, None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        filename = frame.f_code.co_filename
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            module_name = names[id(owner)]
        if not filename.startswith(torch_dir) and "site-packages/torch" not in filename and filename != __file__:
            site = (filename, tb.tb_lineno, frame.f_code.co_name)
        tb = tb.tb_next
    text = str(error)
    if site is None or site[0] == __file__:
        # non-strict export re-raises from torch internals; the message often quotes the user frame
        for line in text.splitlines():
            if line.strip().startswith('File "') and "site-packages/torch" not in line:
                site = (line.strip(), None, None)
    return site, module_name


def explain_export_failure(error: BaseException, model: torch.nn.Module, model_path: str) -> str:
    site, module_name = _failure_site(error, model, model_path)
    message = str(error).strip()
    first_line = message.splitlines()[0] if message else type(error).__name__
    where = ""
    if site is not None:
        filename, lineno, func = site
        if lineno is not None:
            code = traceback.extract_tb(error.__traceback__)
            source = next((f.line for f in reversed(code) if f.filename == filename and f.lineno == lineno), "")
            where = f" at {filename}:{lineno} in {func}" + (f": `{source}`" if source else "")
        else:
            where = f" at {filename}"
    if module_name:
        where += f" (module '{module_name}')"
    lowered = message.lower()
    if "cache" in lowered and ("dynamiccache" in lowered or "cache" in type(error).__name__.lower() or "pytree" in lowered):
        advice = ("the model's output holds a cache object (e.g. transformers' DynamicCache), which torch.export "
                  "cannot return: pass use_cache=False, e.g. example_kwargs() returning {'use_cache': False}")
    elif "data-dependent" in lowered or "data dependent" in lowered or "guardondatadependent" in lowered:
        advice = ("control flow depends on a tensor's values: replace the Python `if`/`.item()` on a tensor with "
                  "torch.where or torch.cond, or compute the condition from shapes or constants")
    elif "unsupported" in lowered or "not supported" in lowered:
        advice = "this Python construct cannot be traced: rewrite it with torch ops, or move it out of forward()"
    else:
        advice = "simplify the code there (no Python side effects or data-dependent control flow in forward())"
    return f"torch.export failed to trace the model{where}: {first_line}\n  what to try: {advice}"
