"""Dynamic dimensions: ``--dynamic`` flags and the model file's ``dynamic_shapes``, named for humans.

``--dynamic idx:1=seq`` marks dim 1 of the input named ``idx`` dynamic under the name ``seq`` (optionally with
a range: ``idx:1=seq[2:64]``); ``--dynamic batch`` marks the batch dim (0, or the model file's
``batch_dim``) of every batched input as one dim ``batch``.
The names become the root symbols of the manifest (``s_seq``, ``s_batch``); every boundary shape is an
expression over them.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

import torch
from torch.export import Dim

_FLAG = re.compile(r"^(?P<input>[A-Za-z_]\w*):(?P<dim>\d+)=(?P<name>[A-Za-z_]\w*)(?:\[(?P<min>\d*):(?P<max>\d*)\])?$")


@dataclass
class DynamicFlags:
    dims: list = field(default_factory=list)  # (input name, dim, dim name, min or None, max or None)
    batch: bool = False


def parse_flags(specs: list) -> DynamicFlags:
    flags = DynamicFlags()
    for spec in specs:
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            if item == "batch":
                flags.batch = True
                continue
            match = _FLAG.match(item)
            if not match:
                raise ValueError(f"--dynamic {item!r} is not INPUT:DIM=NAME (e.g. idx:1=seq, idx:1=seq[2:64]) "
                                 f"or 'batch'")
            low = int(match["min"]) if match["min"] else None
            high = int(match["max"]) if match["max"] else None
            flags.dims.append((match["input"], int(match["dim"]), match["name"], low, high))
    return flags


def _make_dims(flags: DynamicFlags) -> dict:
    dims, ranges = {}, {}
    for _input, _dim, name, low, high in flags.dims:
        if name in ranges and ranges[name] != (low, high) and (low, high) != (None, None):
            raise ValueError(f"--dynamic gives dim '{name}' two different ranges: {ranges[name]} and {(low, high)}")
        if (low, high) != (None, None) or name not in ranges:
            ranges[name] = (low, high)
    if flags.batch:
        ranges.setdefault("batch", (None, None))
    for name, (low, high) in ranges.items():
        kwargs = {}
        if low is not None:
            kwargs["min"] = low
        if high is not None:
            kwargs["max"] = high
        dims[name] = Dim(name, **kwargs)
    return dims


def export_dynamic_shapes(flags: DynamicFlags, model: torch.nn.Module, args: tuple, kwargs: dict,
                          batched_args: dict, batch_dim: int = 0) -> tuple:
    """``dynamic_shapes`` for torch.export (a dict by forward() argument name) and {(arg name, dim): name}.

    ``batched_args`` maps each top-level tensor argument name to whether it is chunked into microbatches (along
    ``batch_dim``, the dim ``--dynamic batch`` marks).
    """
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    tensors = {name: value for name, value in bound.arguments.items() if isinstance(value, torch.Tensor)}
    dims = _make_dims(flags)
    spec: dict = {}
    names: dict = {}
    for input_name, dim, name, _lo, _hi in flags.dims:
        if input_name not in tensors:
            raise ValueError(f"--dynamic {input_name}:{dim}={name}: forward() has no tensor input '{input_name}'; "
                             f"its tensor inputs are {', '.join(tensors) or 'none'}")
        if dim >= tensors[input_name].dim():
            raise ValueError(f"--dynamic {input_name}:{dim}={name}: '{input_name}' has only "
                             f"{tensors[input_name].dim()} dims (shape {tuple(tensors[input_name].shape)})")
        spec.setdefault(input_name, {})[dim] = dims[name]
        names[(input_name, dim)] = name
    if flags.batch:
        for input_name, is_batched in batched_args.items():
            if is_batched and input_name in tensors:
                spec.setdefault(input_name, {}).setdefault(batch_dim, dims["batch"])
                names.setdefault((input_name, batch_dim), "batch")
    for name in signature.parameters:
        if name in bound.arguments and name not in spec:
            spec[name] = None
    return spec, names


def names_from_model_spec(dynamic_shapes, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """{(arg name, dim): Dim name} from a model file's own ``dynamic_shapes`` (dict by name or tuple)."""
    if dynamic_shapes is None:
        return {}
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    arg_names = list(bound.arguments)
    if isinstance(dynamic_shapes, dict):
        items = dynamic_shapes.items()
    else:
        items = zip(arg_names, dynamic_shapes)
    names = {}
    for arg_name, dims in items:
        if isinstance(dims, dict):
            pairs = dims.items()
        elif isinstance(dims, (list, tuple)):
            pairs = enumerate(dims)
        else:
            continue
        for dim, value in pairs:
            name = getattr(value, "__name__", None)
            if isinstance(name, str) and re.match(r"^[A-Za-z_]\w*$", name):
                names[(arg_name, int(dim))] = name
    return names
