"""Receive-buffer shapes from static metadata: ints, or Python expressions over the root symbols.

The manifest stores each boundary tensor's shape as a list whose entries are ints or Python expressions
(printed from sympy at codegen time), e.g. ``["s_batch", "s_seq", 64]``. Each step, every rank binds the root
symbols from its own copy of the batch and evaluates the shapes: no shape is ever exchanged.
"""
from __future__ import annotations

import math
import re

_IDENTIFIER = re.compile(r"\b([A-Za-z_][A-Za-z_0-9]*)\b")

_SAFE = {"__builtins__": {}, "int": int, "floor": math.floor, "ceil": math.ceil, "max": max, "min": min, "abs": abs,
         "math": math}


def activation_key(name: str, producer: int) -> str:
    """How a rank script names a received activation (its ``boundary_shapes`` key and the stage function's
    parameter): ``layers_5_out_from_stage0``."""
    return f"{name}_from_stage{producer}"


def gradient_key(name: str, consumer: int) -> str:
    """How a rank script names the gradient a consumer sends back for a value: ``grad_layers_5_out_from_stage1``
    where it is received, ``grad_layers_5_out_to_stage0`` (:func:`gradient_sent`) where it is sent."""
    return f"grad_{name}_from_stage{consumer}"


def activation_sent(name: str, consumer: int) -> str:
    """How a rank script names an activation where it is sent: ``layers_5_out_to_stage1``."""
    return f"{name}_to_stage{consumer}"


def gradient_sent(name: str, producer: int) -> str:
    """How a rank script names a gradient where it is sent back: ``grad_layers_5_out_to_stage0``."""
    return f"grad_{name}_to_stage{producer}"


def compile_shape(shape: list):
    """Return ``fn(symbols) -> tuple[int, ...]`` for a manifest shape list."""
    if all(isinstance(dim, int) for dim in shape):
        fixed = tuple(shape)
        return lambda symbols: fixed
    source = "lambda s: (" + "".join(f"int({_as_expr(d)})," for d in shape) + ")"
    fn = eval(compile(source, "<tracepp shape>", "eval"), dict(_SAFE))
    return fn


def _as_expr(dim) -> str:
    if isinstance(dim, int):
        return str(dim)
    # symbol names are plain identifiers: look them up in the dict of bound symbols
    return _IDENTIFIER.sub(lambda m: m.group(1) if m.group(1) in _SAFE else f"s[{m.group(1)!r}]", dim)
