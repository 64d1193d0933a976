"""Parse ``tracepp plan --costs FILE``: measured compute times per action kind and per stage."""
from __future__ import annotations

import json
import os
import re

# keys a costs file may carry besides the times: what ``tracepp calibrate`` records with them
METADATA_KEYS = ("microbatch_size", "optimizer_s", "source", "clock", "note")


def load_costs(path: str, num_stages: int) -> dict:
    """Read measured compute times for ``tracepp plan --costs``: ``{"F": 1.0, "B": 2.0}`` per action kind,
    ``{"0F": 1.2, "1B": 2.5}`` per stage, or both (a stage's own entry wins).

    Returns the mapping :func:`tracepp.codegen.simulate.cost_of` reads (kind or (stage, kind) -> time).
    A ``B`` given without ``I`` and ``W`` at the same level also prices the split backward: I = W = B / 2.
    The keys of :data:`METADATA_KEYS` (``"microbatch_size"``: samples per microbatch the times were measured at;
    ``"optimizer_s"``: ``{stage: seconds}`` of the optimizer step) are read by ``tracepp calibrate`` and skipped
    here (:func:`load_costs_metadata`).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--costs {path}: no such file")
    with open(path) as handle:
        try:
            raw = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"--costs {path}: not valid JSON ({error}); expected e.g. "
                             f'{{"F": 1.0, "B": 2.0}} or {{"0F": 1.2, "1B": 2.5}}') from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--costs {path}: expected a non-empty JSON object such as "
                         f'{{"F": 1.0, "B": 2.0}} or {{"0F": 1.2, "1B": 2.5}}, got {type(raw).__name__}')
    costs: dict = {}
    for key, value in raw.items():
        if key in METADATA_KEYS:
            continue
        match = re.fullmatch(r"(\d+)?([FBIW])", str(key).strip())
        if not match:
            raise ValueError(f"--costs {path}: key {key!r} is not an action kind (F, B, I, W) or a stage "
                             f"followed by one (e.g. '0F', '3B')")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"--costs {path}: {key!r} is {value!r}; times must be positive numbers")
        stage, kind = match.groups()
        if stage is None:
            costs[kind] = float(value)
        else:
            if int(stage) >= num_stages:
                raise ValueError(f"--costs {path}: key {key!r} names stage {stage}, but the plan has stages "
                                 f"0..{num_stages - 1}")
            costs[(int(stage), kind)] = float(value)
    for scope in [None] + list(range(num_stages)):
        name = (lambda kind: kind) if scope is None else (lambda kind, s=scope: (s, kind))
        if name("B") in costs and name("I") not in costs and name("W") not in costs:
            costs[name("I")] = costs[name("W")] = costs[name("B")] / 2
    return costs


def load_costs_metadata(path: str) -> dict:
    """The :data:`METADATA_KEYS` entries of a costs file (``microbatch_size``, ``optimizer_s``, ...), checked."""
    with open(path) as handle:
        raw = json.load(handle)
    meta = {key: raw[key] for key in METADATA_KEYS if isinstance(raw, dict) and key in raw}
    size = meta.get("microbatch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0):
        raise ValueError(f"--costs {path}: 'microbatch_size' is {size!r}; give the samples per microbatch the times "
                         f"were measured at, a positive number")
    optimizer = meta.get("optimizer_s")
    if optimizer is not None and not (isinstance(optimizer, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in optimizer.values())):
        raise ValueError(f"--costs {path}: 'optimizer_s' must map stages to seconds, e.g. {{\"0\": 0.002}}")
    return meta
