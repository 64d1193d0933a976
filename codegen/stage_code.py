"""Python source of one stage's forward, from torch.fx's own code generator.

The function takes the stage's parameters/buffers, its root inputs and its received values (in the
manifest's order) and returns the values it sends on (the last stage: the model's output leaves). fx writes
shape annotations (``"f32[4, 16, 64]"``) and a ``# File: model.py:42 in forward`` comment per source line;
we trim each node's stack trace to the user's own frames so those comments point at the model file, not at
torch internals.
"""
from __future__ import annotations

import os
import re

import torch
import torch.fx as fx

from tracepp.split.pipeline_graph import Stage

_TORCH_DIR = os.path.dirname(torch.__file__)

RUN_DEVICE = "RUN_DEVICE"  # the rank script's global naming this rank's device; the runtime sets it


class _RunDevice:
    """Stands in for the device export baked into factory calls (``torch.arange(n, device=idx.device)``
    traced on CPU becomes ``device=cpu``): fx prints it as ``RUN_DEVICE``, so the same stage code runs on
    whatever device the rank gets (``cuda:LOCAL_RANK`` under NCCL, CPU under gloo)."""

    def __repr__(self) -> str:
        return RUN_DEVICE


class _RunDeviceType:
    """Prints as ``RUN_DEVICE.type``: the autocast device type of the rank's device ("cuda", "cpu")."""

    def __repr__(self) -> str:
        return f"{RUN_DEVICE}.type"


def _autocast_off_regions(graph: fx.Graph) -> None:
    """Nodes traced inside ``torch.autocast(enabled=False)`` (marked by the trace step) run with autocast off
    again: ``torch.amp._enter_autocast`` before each run of them and ``_exit_autocast`` after, as export's own
    pre-dispatch graphs do. Without it, ``--precision bf16`` would compute HF's rotary tables in bf16."""
    from tracepp.trace import AUTOCAST_OFF

    region = None
    for node in list(graph.nodes):
        marked = bool(node.meta.get(AUTOCAST_OFF))
        if marked and region is None:
            with graph.inserting_before(node):
                region = graph.call_function(torch.amp._enter_autocast, (_RunDeviceType(), None, False, None))
        elif not marked and region is not None:
            with graph.inserting_before(node):
                graph.call_function(torch.amp._exit_autocast, (region,))
            region = None


def _drop_metadata_asserts(graph: fx.Graph) -> None:
    """Export records each ``x.to(dtype)`` with an ``_assert_tensor_metadata`` check of the traced dtype and
    device. A stage runs on another device, and under ``--precision bf16`` its autocast regions produce bf16
    where the trace saw fp32, so those checks would fail on correct values; they compute nothing, so they go."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default \
                and not node.users:
            graph.erase_node(node)


def _is_trace_device(value) -> bool:
    return isinstance(value, torch.device) and value.type == "cpu"


def _follow_run_device(graph: fx.Graph) -> None:
    """Every ``device`` the trace recorded, keyword (``arange(..., device=cpu)``) or positional
    (``aten.to.device(x, cpu, float32)`` from ``x.to(other.device)``), becomes ``RUN_DEVICE``."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _is_trace_device(node.kwargs.get("device")):
            node.update_kwarg("device", _RunDevice())
        for position, value in enumerate(node.args):
            if _is_trace_device(value):
                node.update_arg(position, _RunDevice())


def _user_stack(trace: str) -> str:
    """Keep the stack trace up to the last frame outside torch (the user's line that called into torch)."""
    lines = trace.rstrip().splitlines()
    keep_until = None
    for i, line in enumerate(lines):
        if line.strip().startswith('File "') and _TORCH_DIR not in line and "site-packages/torch/" not in line:
            keep_until = i
    if keep_until is None:
        return trace
    end = keep_until + 1
    while end < len(lines) and not lines[end].strip().startswith('File "'):
        end += 1
    return "\n".join(lines[:end])


def stage_source(stage: Stage, function_name: str, model_path: str = "") -> tuple:
    """Return (source, names of globals it needs) for ``def function_name(...)``."""
    graph = fx.Graph()
    env: dict = {}
    for node in stage.graph.nodes:  # a copy, so trimming stack traces leaves the split result untouched
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.meta.get("stack_trace"):
            env[node].meta["stack_trace"] = _user_stack(node.meta["stack_trace"])
    _follow_run_device(graph)
    _drop_metadata_asserts(graph)
    _autocast_off_regions(graph)
    code = graph.python_code(root_module="self", verbose=True)
    source = code.src.strip("\n")
    source = re.sub(r"^def forward\(self,?\s*", f"def {function_name}(", source, count=1)
    if model_path:  # "# File: /home/me/proj/model.py:42" -> "# File: model.py:42"
        source = source.replace(f"# File: {model_path}:", f"# File: {os.path.basename(model_path)}:")
    used = {name for name in code.globals if re.search(rf"\b{re.escape(name)}\b", source.split(":", 1)[-1])}
    if re.search(rf"\b{RUN_DEVICE}\b", source):
        used.add(RUN_DEVICE)
    source = "\n".join(line.rstrip() for line in source.splitlines())  # fx leaves indented blank lines
    return _one_parameter_per_line(source), used


def _one_parameter_per_line(source: str) -> str:
    """``def f(a: "f32[2]", b: "i64[2, 3]"):`` on one long line -> one parameter per line when it is long."""
    first, _, rest = source.partition("\n")
    match = re.fullmatch(r"def (\w+)\((.*)\):", first)
    if match is None or len(first) <= 110:
        return source
    params = re.findall(r'\w+(?:: "[^"]*")?', match.group(2))
    if ", ".join(params) != match.group(2):  # something fancier than `name: "annotation"`: leave it alone
        return source
    lines = [f"def {match.group(1)}("] + [f"    {param}," for param in params] + ["):"]
    return "\n".join(lines) + ("\n" + rest if rest else "")


def globals_prelude(names: set) -> str:
    """Imports for the names fx's generated code refers to."""
    lines = []
    if "inf" in names or "nan" in names:
        lines.append("from math import inf, nan")
    if "device" in names:
        lines.append("from torch import device")
    if RUN_DEVICE in names:
        lines.append(f"{RUN_DEVICE} = torch.device(\"cpu\")  # factory ops' device: the runtime sets this rank's device")
    if "NoneType" in names:
        lines.append("NoneType = type(None)")
    if "fx_pytree" in names:
        lines.append("import torch.fx._pytree as fx_pytree")
    if "pytree" in names:
        lines.append("import torch.utils._pytree as pytree")
    return "\n".join(lines)
