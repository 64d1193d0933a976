"""Names for the values a reader follows from stage to stage and from block to block.

export names a node after its op (``add_4``, ``linear_16``, ``detach_default``); a rank script that receives
``add_4_from_stage0`` does not say what crosses. Every value that leaves a repeated block or a top-level module,
crosses a stage boundary, is recomputed by a later stage or is a model output is named here instead, after what
made it:

* the outermost module it leaves: ``layers_5_out`` (``model.layers.5``), ``embed_tokens_out``, ``h_3_out``;
  where that module lets several values out, the source variable tells them apart: ``rotary_emb_cos``,
  ``rotary_emb_sin``;
* else the variable the model's source assigns it to (``causal_mask = create_causal_mask(...)``, or the
  key of a dict entry: ``"sliding_attention": create_sliding_window_causal_mask(...)``);
* a size: the root symbol it equals (``s_seq``) or its expression (``s_seq_plus_1``);
* else export's name stays (``add_4``).

All names come from one namespace, fx's own ``_Namespace`` (legal identifiers, unique, never a builtin), seeded
with every node name of the traced program so that a chosen name never collides with a name export chose.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
import torch.fx as fx
from torch.fx.graph import _Namespace

_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
# ``name = ...`` or ``name: type = ...``; or a dict entry ``"name": ...`` (HF's per-layer-type mask mapping)
_ASSIGNMENT = re.compile(r"^(?:([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)|[\"']([A-Za-z_]\w*)[\"']\s*:)")
_NOT_A_VARIABLE = {"self"}  # `self.x = ...` assigns an attribute, not a variable


class Namespace:
    """The one helper that makes generated identifiers: legal, unique, never shadowing a builtin or a name
    given before (fx's ``_Namespace``)."""

    def __init__(self, reserved: Iterable[str] = ()):
        self._namespace = _Namespace()
        for name in reserved:
            self._namespace.create_name(name, None)

    def create(self, candidate: str) -> str:
        return self._namespace.create_name(candidate, None)


def module_paths(node: fx.Node) -> list:
    """The node's module path, outermost first, without the root ("" ) and export's placeholder entries."""
    from tracepp.split.partition import node_modules

    return [path for path in node_modules(node) if path and not path.startswith("_empty_nn_module_stack")]


def short_module_name(path: str) -> str:
    """``model.layers.5`` -> ``layers_5``, ``model.layers.5.mlp`` -> ``layers_5_mlp``, ``transformer.h.3`` ->
    ``h_3``, ``model.embed_tokens`` -> ``embed_tokens``: from the container of the first numbered part, else the
    last part."""
    parts = path.split(".")
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if numbered is None:
        return parts[-1]
    return "_".join(parts[max(numbered - 1, 0):])


def starred(path: str) -> str:
    """``model.layers.3.attn.q_proj.weight`` -> ``model.layers.*.attn.q_proj.weight`` (every numbered part, a
    trailing one too: ``model.layers.3`` -> ``model.layers.*``): one name for a repeated block's members, the unit
    inspect groups rows by and a plan choice is tried and kept by."""
    return re.sub(r"(?<![^.])\d+(?![^.])", "*", path)


def frames(trace: Optional[str]) -> list:
    """``(file, line, function, code)`` per frame of a node's stack trace, outermost first."""
    lines = (trace or "").rstrip().splitlines()
    found = []
    for i, line in enumerate(lines):
        match = _FRAME.match(line)
        if match:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            found.append((match.group(1), int(match.group(2)), match.group(3), code))
    return found


def source_variable(node: fx.Node, depth: int = 4) -> Optional[str]:
    """The variable the model's source assigns this value (or the value it is a cast, detach or view of) to:
    ``cos = emb.cos() * scale`` -> ``cos``. Only the last value of a line is what it assigns (in
    ``x = self.embed(idx) + self.pos(torch.arange(n))`` the ``arange`` is not ``x``). None when no such line
    is found within ``depth`` producers."""
    current = node
    for _ in range(depth):
        trace = frames(current.meta.get("stack_trace"))
        if trace:
            match = _ASSIGNMENT.match(trace[-1][3])
            variable = match and (match.group(1) or match.group(2))
            line = trace[-1][:3]
            last_of_line = not any(line in [frame[:3] for frame in frames(user.meta.get("stack_trace"))]
                                   for user in current.users)
            if variable and variable not in _NOT_A_VARIABLE and last_of_line:
                return variable
        producers = [arg for arg in current.all_input_nodes if arg.op != "placeholder"]
        if len(producers) != 1:
            return None
        current = producers[0]
    return None


def _size_name(expr, symbol_names: dict) -> Optional[str]:
    """``s_seq`` for a size that is a root symbol, ``s_seq_plus_1`` for a simple expression over them."""
    renamed = expr.xreplace(symbol_names)
    if renamed.is_Symbol:
        return str(renamed)
    if renamed.free_symbols - set(symbol_names.values()):
        return None
    words = {"+": "plus", "-": "minus", "*": "times", "//": "div", "/": "div", "%": "mod", "**": "pow"}
    tokens = re.findall(r"\w+|//|\*\*|[-+*/%]", str(renamed))
    return "_".join(words.get(token, token) for token in tokens) or None


class _Exits:
    """For each node, the outermost module it leaves (a user runs outside it); per module, how many do."""

    def __init__(self, nodes: Iterable[fx.Node]):
        self.outermost: dict = {}
        self.count: dict = {}
        for node in nodes:
            if node.op in ("placeholder", "output"):
                continue
            paths = module_paths(node)
            user_paths = [set(module_paths(user)) if user.op != "output" else set() for user in node.users]
            left = [path for path in paths if any(path not in inside for inside in user_paths)]
            if left:
                self.outermost[node] = left[0]
                self.count[left[0]] = self.count.get(left[0], 0) + 1


def value_names(graph: fx.Graph, nodes: Iterable[fx.Node], symbol_names: dict) -> dict:
    """{node: readable unique name} for ``nodes`` (in graph order), see the module docstring.

    ``symbol_names``: export's sympy symbol -> ours (``s95`` -> ``s_seq``)."""
    wanted = set(nodes)
    namespace = Namespace(node.name for node in graph.nodes)
    exits = _Exits(graph.nodes)
    names = {}
    for node in graph.nodes:
        if node not in wanted or node.op == "placeholder":
            continue
        candidate = _candidate(node, exits, symbol_names)
        if candidate is not None:  # else export's own name (``add_4``) says as much as any
            names[node] = namespace.create(candidate)
    return names


def _candidate(node: fx.Node, exits: _Exits, symbol_names: dict) -> Optional[str]:
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        return _size_name(val.node.expr, symbol_names) or "size"
    module = exits.outermost.get(node)
    if module is not None:
        short = short_module_name(module)
        if exits.count[module] == 1:
            return f"{short}_out"
        variable = source_variable(node)
        return f"{short}_{variable}" if variable else f"{short}_out"
    return source_variable(node)
