"""State the runtime's custom ops share across every copy of the runtime in one process.

A rank process may hold two copies of this package: the output folder's ``tracepp_runtime`` and, where tracepp
is installed, ``tracepp.runtime`` (imported by ``import tracepp``, e.g. for ``pipe_split``). The custom ops
(``torch.ops.tracepp.*``) are registered once, by whichever copy is imported first, and their implementations
read module-level state (the tensor- and expert-parallel groups, the token counts per expert). Kept here, in one
process-wide holder, that state is the same whichever copy registered the ops and whichever copy the runtime sets
it through. Standard library only.
"""
from __future__ import annotations

import sys
import types

_HOLDER = "_tracepp_runtime_process_state"


def shared(name: str, default):
    """The process-wide object ``name``, created from ``default`` by the first copy that asks."""
    holder = sys.modules.get(_HOLDER)
    if holder is None:
        holder = sys.modules.setdefault(_HOLDER, types.ModuleType(_HOLDER))
    if not hasattr(holder, name):
        setattr(holder, name, default)
    return getattr(holder, name)
