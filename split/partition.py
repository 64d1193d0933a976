"""Step 2, split: cut the traced graph into stage graphs at split points.

Split points are ``pipe_split()`` markers in the graph, module FQNs (a stage begins at the first node that
runs inside that module), or, with neither, ``num_stages`` cuts balanced by parameter count. Every node
then belongs to the stage of its position; a value used on a later stage becomes a boundary value with its
metadata taken from the traced node's ``meta["val"]``.
"""
from __future__ import annotations

import difflib
import re
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from tracepp.runtime.markers import PIPE_SPLIT_OP
from tracepp.split.pipeline_graph import (BoundaryValue, PipelineGraph, RootInput, Stage, StateRef,
                                          TensorMeta)


class SplitError(ValueError):
    """The requested split cannot be made."""


_STATE_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                InputKind.CONSTANT_TENSOR: "constant"}


def module_path(raw: str) -> str:
    """Normalise an nn_module_stack path to the FQN ``named_modules()`` uses.

    torch 2.13's export (strict or not) already records "model.layers.1"; dynamo-style spellings
    ("L['self'].model.layers[1]", "L['self']._modules['model']._modules['layers']['1']") are mapped too.
    """
    raw = re.sub(r"^L\['self'\]", "", raw)
    raw = re.sub(r"\.?_modules\['([^']+)'\]", r".\1", raw)
    raw = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", raw)
    return raw.strip(".")


def node_modules(node: fx.Node) -> list:
    stack = node.meta.get("nn_module_stack") or {}
    return [module_path(path) for path, _type in stack.values()]


def expr_text(expr, names: dict) -> object:
    """A sympy expression as Python source over the friendly root symbols ("s_batch*s_seq", "(s_seq//2)")."""
    from torch.utils._sympy.printers import PythonPrinter

    if expr.is_number:
        return int(expr)
    renamed = expr.xreplace(names)
    unknown = renamed.free_symbols - set(names.values())
    if unknown:
        raise SplitError(
            f"a size {expr} depends on {', '.join(sorted(map(str, unknown)))}, which no input's shape determines "
            f"(a data-dependent size, e.g. from nonzero() or .item()); every rank must be able to compute "
            f"boundary shapes from the batch alone: move the split point so that the value stays inside one "
            f"stage, or make the size a function of input shapes")
    return PythonPrinter().doprint(renamed)


def listed_module(node: fx.Node) -> str:
    """The module a node is listed under in stage tables: the first repeated block on its module path
    ("model.layers.3", "blocks.0"), else a child of a top-level container ("model.embed_tokens"), else the
    top-level module itself ("lm_head")."""
    paths = [path for path in node_modules(node) if path]
    for path in paths:
        if any(part.isdigit() for part in path.split(".")):
            return path
    return paths[1] if len(paths) > 1 else (paths[0] if paths else "")


def dim_text(dim, names: dict) -> object:
    if isinstance(dim, int):
        return dim
    if isinstance(dim, torch.SymInt):
        return expr_text(dim.node.expr, names)
    return str(dim)


def tensor_meta(val, requires_grad: bool, names: dict) -> TensorMeta:
    dtype = str(val.dtype).replace("torch.", "")
    return TensorMeta([dim_text(d, names) for d in val.shape], dtype,
                      requires_grad and val.dtype.is_floating_point)


def _finite(bound):
    """An int for a finite range bound, None for +-infinity (sympy's oo or torch's int_oo)."""
    import sympy

    if bound is None or bound in (sympy.oo, -sympy.oo) or "Infinity" in type(bound).__name__:
        return None
    return int(bound)


def _root_symbols(program, root_nodes: list, dim_names: dict) -> tuple:
    """Name every symbol of the inputs' shapes after its dynamic dim: {sympy symbol: sympy symbol 's_seq'}.

    Returns (renaming, table) where table maps each friendly name to its declared range and where it is read.
    """
    import sympy

    renaming, table = {}, {}
    for node, root in root_nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            symbol = size.node.expr
            if symbol in renaming:
                continue
            base = dim_names.get((root.leaf_index, dim)) or f"{root.placeholder}_{dim}"
            name = f"s_{base}"
            while name in table:
                name += "_"
            renaming[symbol] = sympy.Symbol(name, integer=True, positive=True)
            bounds = program.range_constraints.get(symbol)
            low = _finite(bounds.lower) if bounds is not None else None
            high = _finite(bounds.upper) if bounds is not None else None
            low = 0 if low is None else low
            table[name] = {"min": low, "max": high, "source": f"{root.path} dim {dim}"}
    return renaming, table


def _leaf_paths(in_spec) -> list:
    """Readable names of the flattened (args, kwargs) leaves: args[0], kwargs['mask'], ..."""
    dummy = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    paths, _ = pytree.tree_flatten_with_path(dummy)
    names = []
    for key_path, _leaf in paths:
        text = pytree.keystr(key_path)  # "[0][0]" / "[1]['mask']"
        text = re.sub(r"^\[0\]", "args", text)
        text = re.sub(r"^\[1\]\[(.*?)\]", r"kwargs[\1]", text)
        names.append(text)
    return names


def _boundaries_from_modules(nodes: list, split_points: list, model: torch.nn.Module) -> list:
    known = [name for name, _ in model.named_modules() if name]
    positions = []
    for fqn in split_points:
        position = next((i for i, node in enumerate(nodes) if fqn in node_modules(node)), None)
        if position is None:
            if fqn in known:
                raise SplitError(f"split point '{fqn}' names a module that the traced forward never runs; "
                                 f"pick a module that forward() calls")
            close = difflib.get_close_matches(fqn, known, n=5, cutoff=0.5)
            prefix = fqn.rsplit(".", 1)[0] if "." in fqn else None
            siblings = [k for k in known if prefix and k.rsplit(".", 1)[0] == prefix and k.count(".") == fqn.count(".")]
            nearby = siblings or close or known[:8]
            raise SplitError(
                f"split point '{fqn}' not found; the model has {_span(nearby)}"
                + (" (names from model.named_modules())" if not siblings else "")
            )
        positions.append((position, fqn))
    for (pos_a, fqn_a), (pos_b, fqn_b) in zip(positions, positions[1:]):
        if pos_b <= pos_a:
            raise SplitError(
                f"split points are not in execution order: '{fqn_b}' runs "
                f"{'before' if pos_b < pos_a else 'together with'} '{fqn_a}'; "
                f"list them in the order forward() runs them, e.g. {', '.join(f for _, f in sorted(positions))}"
            )
    return [position for position, _ in positions]


def _span(names: list) -> str:
    if len(names) > 6:
        return ", ".join(names[:3]) + " … " + ", ".join(names[-2:])
    return ", ".join(names)


def _balanced_boundaries(nodes: list, num_stages: int, state_placeholders: set) -> list:
    """Cuts at module boundaries that balance parameter count (plus a little per op) across stages."""
    seen, costs, candidates = set(), [], []
    previous_key = None
    for i, node in enumerate(nodes):
        cost = 1.0
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg.name not in seen and isinstance(arg.meta.get("val"), torch.Tensor):
                seen.add(arg.name)
                if arg.name in state_placeholders:
                    cost += arg.meta["val"].numel()
        costs.append(cost)
        modules = node_modules(node)
        key = modules[1] if len(modules) > 1 else (modules[0] if modules else "")
        if i > 0 and key != previous_key:
            candidates.append(i)
        previous_key = key
    if len(candidates) < num_stages - 1:
        raise SplitError(
            f"cannot make {num_stages} stages: the model has only {len(candidates) + 1} module-level segments; "
            f"use fewer stages or mark cuts with pipe_split()"
        )
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    total, chosen, start = prefix[-1], [], 0
    for k in range(1, num_stages):
        target = total * k / num_stages
        usable = [c for c in candidates if c > start and len([x for x in candidates if x > c]) >= num_stages - 1 - k]
        best = min(usable, key=lambda c: abs(prefix[c] - target))
        chosen.append(best)
        start = best
    return chosen


def split(traced, split_points: Optional[list] = None, num_stages: Optional[int] = None,
          default_stages: int = 1) -> PipelineGraph:
    """Cut at markers, else at ``split_points``, else into ``num_stages or default_stages`` balanced stages."""
    program = traced.program
    signature = program.graph_signature
    graph = program.graph
    if signature.buffers_to_mutate:
        names = ", ".join(sorted(signature.buffers_to_mutate.values()))
        raise SplitError(f"the model mutates buffers in forward ({names}), e.g. BatchNorm running statistics; "
                         "tracepp does not pipeline buffer mutation yet: use LayerNorm/GroupNorm or eval-mode "
                         "statistics")

    # -- the program's inputs: state (params, buffers, constants) and the batch's leaves
    aliases: dict = {}
    for fqn, tensor in list(traced.model.named_parameters(remove_duplicate=False)) + list(
            traced.model.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(tensor), []).append(fqn)
    fqn_to_tensor = dict(traced.model.named_parameters(remove_duplicate=False))
    fqn_to_tensor.update(traced.model.named_buffers(remove_duplicate=False))

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state: dict = {}
    root_inputs: dict = {}
    leaf_paths = _leaf_paths(traced.program.call_spec.in_spec)
    user_index = 0
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind in _STATE_KINDS:
            fqn = spec.target
            tensor = fqn_to_tensor.get(fqn)
            names = aliases.get(id(tensor), [fqn]) if tensor is not None else [fqn]
            state[node.name] = StateRef(node.name, fqn, sorted(names), _STATE_KINDS[spec.kind],
                                        persistent=spec.persistent is not False)
        elif spec.kind == InputKind.USER_INPUT:
            root_inputs[node.name] = RootInput(node.name, user_index, leaf_paths[user_index],
                                               traced.batched_leaves[user_index], None)
            user_index += 1
        else:
            raise SplitError(f"unsupported program input '{node.name}' of kind {spec.kind.name}")
    node_by_name = {n.name: n for n in graph.nodes}
    names, symbols = _root_symbols(program, [(node_by_name[r.placeholder], r) for r in root_inputs.values()],
                                   getattr(traced, "dim_names", {}))
    for root in root_inputs.values():
        val = node_by_name[root.placeholder].meta.get("val")
        if isinstance(val, torch.Tensor):
            root.meta = tensor_meta(val, False, names)
    batch_symbol = next((r.meta.shape[0] for r in root_inputs.values()
                         if r.batched and r.meta is not None and isinstance(r.meta.shape[0], str)), None)

    # -- stage of every compute node, from the split points
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    markers = [i for i, n in enumerate(compute) if n.target is PIPE_SPLIT_OP]
    if markers and split_points:
        raise SplitError("the model calls pipe_split() and split points were also given; use one or the other")
    if markers:
        boundaries = [i - k for k, i in enumerate(markers)]  # positions once markers are removed
        compute = [n for n in compute if n.target is not PIPE_SPLIT_OP]
        if num_stages is not None and num_stages != len(boundaries) + 1:
            raise SplitError(f"the model's pipe_split() markers make {len(boundaries) + 1} stages, "
                             f"but --stages {num_stages} was given")
    elif split_points:
        boundaries = _boundaries_from_modules(compute, split_points, traced.model)
        if num_stages is not None and num_stages != len(boundaries) + 1:
            raise SplitError(f"{len(split_points)} split points make {len(boundaries) + 1} stages, "
                             f"but --stages {num_stages} was given")
    else:
        wanted = num_stages or default_stages
        boundaries = _balanced_boundaries(compute, wanted, set(state)) if wanted > 1 else []
    count = len(boundaries) + 1
    edges = [0] + boundaries + [len(compute)]
    for index in range(count):
        if edges[index + 1] <= edges[index]:
            raise SplitError(f"stage {index} would be empty: two split points fall at the same place in the graph")
    stage_of: dict = {}
    for index in range(count):
        for node in compute[edges[index]:edges[index + 1]]:
            stage_of[node] = index
    last = count - 1

    # -- which values need a gradient (floating point and downstream of a trainable parameter)
    trainable = {name for name, ref in state.items() if ref.kind == "parameter"
                 and getattr(fqn_to_tensor.get(ref.fqn), "requires_grad", True)}
    needs_grad: dict = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            needs_grad[node] = node.name in trainable
        elif node.target is torch.ops.aten.detach.default:  # e.g. the outputs of an inlined no_grad block
            needs_grad[node] = False
        elif node.op != "output":
            needs_grad[node] = any(needs_grad.get(arg, False) for arg in node.all_input_nodes)

    # -- outputs of the model: all consumed on the last stage (the loss runs there)
    output_node = next(n for n in graph.nodes if n.op == "output")
    out_leaves = list(output_node.args[0])
    output_leaves = []
    used_on: dict = {}  # node -> set of stages that read it

    def use(node: fx.Node, stage_index: int):
        used_on.setdefault(node, set()).add(stage_index)

    for node in compute:
        for arg in node.all_input_nodes:
            use(arg, stage_of[node])
    for leaf in out_leaves:
        if isinstance(leaf, fx.Node):
            use(leaf, last)
            output_leaves.append(("value", leaf.name))
        else:
            output_leaves.append(("const", leaf))

    values: dict = {}
    sym_values: dict = {}  # name -> (producer, consumers, python expression)
    for node, stages in used_on.items():
        if node.op == "placeholder":
            ref = state.get(node.name) or root_inputs.get(node.name)
            ref.stages = sorted(stages)
            continue
        later = sorted(s for s in stages if s != stage_of[node])
        if not later:
            continue
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            # a size (e.g. `T = idx.shape[1]` used by every layer): each consumer evaluates it from the
            # step's root symbols instead of receiving it
            sym_values[node.name] = (stage_of[node], later, dim_text(val, names))
            continue
        if not isinstance(val, torch.Tensor):
            raise SplitError(
                f"value '{node.name}' ({type(val).__name__}) made on stage {stage_of[node]} is used on stage(s) "
                f"{later}; only tensors may cross a stage boundary: move the split point so that "
                f"{_describe(node)} and its users fall on one stage"
            )
        values[node.name] = BoundaryValue(node.name, stage_of[node], later, tensor_meta(val, needs_grad[node], names))

    # -- build each stage's graph
    stages = []
    for index in range(count):
        stage_graph = fx.Graph()
        env: dict = {}
        stage_state = [name for name, ref in state.items() if index in ref.stages]
        stage_roots = [name for name, ref in root_inputs.items() if index in ref.stages]
        received = [(value.producer, name) for name, value in values.items() if index in value.consumers]
        received.sort()
        for name in stage_state + stage_roots:
            original = node_by_name[name]
            env[original] = stage_graph.placeholder(name)
            env[original].meta = dict(original.meta)
        for producer, name in received:
            original = node_by_name[name]
            env[original] = stage_graph.placeholder(f"{name}_from_stage{producer}")
            env[original].meta = {"val": original.meta.get("val")}
        stage_sym_inputs = []
        for name, (producer, consumers, expr) in sym_values.items():
            if index in consumers:
                original = node_by_name[name]
                env[original] = stage_graph.placeholder(name)
                env[original].meta = {"val": original.meta.get("val")}
                stage_sym_inputs.append((name, expr))
        modules_seen: list = []
        for node in compute[edges[index]:edges[index + 1]]:
            env[node] = stage_graph.node_copy(node, lambda n: env[n])
            fqn = listed_module(node)
            if fqn and fqn not in modules_seen:
                modules_seen.append(fqn)
        if index == last:
            outputs = [name for kind, name in output_leaves if kind == "value"]
            result = tuple(env[node_by_name[leaf]] if kind == "value" else leaf for kind, leaf in output_leaves)
        else:
            outputs = [name for name, value in values.items() if value.producer == index]
            result = tuple(env[node_by_name[name]] for name in outputs)
        stage_graph.output(result)
        stage_graph.lint()
        stages.append(Stage(index, stage_graph, stage_state, stage_roots, received, outputs, modules_seen,
                            stage_sym_inputs))

    used_ids = {id(fqn_to_tensor.get(ref.fqn)) for ref in state.values() if ref.stages}
    unused_state = {}
    for fqn, tensor in traced.model.state_dict(keep_vars=True).items():
        if id(tensor) not in used_ids:
            unused_state[fqn] = tensor.detach().clone()
    for name, ref in list(state.items()):  # drop unused alias placeholders (the tied copy export left behind)
        if not ref.stages:
            del state[name]
    return PipelineGraph(stages, values, state, root_inputs, len(traced.batched_leaves),
                         traced.program.call_spec.in_spec, traced.program.call_spec.out_spec, output_leaves,
                         unused_state, symbols, batch_symbol, {str(k): str(v) for k, v in names.items()})


def _describe(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    where = trace[-2].strip() if len(trace) >= 2 else ""
    return f"'{node.name}' ({where})" if where else f"'{node.name}'"
