"""Step 2, split: cut the traced graph into stage graphs at split points.

Split points are ``pipe_split()`` markers in the graph, module FQNs (a stage begins at the first node that
runs inside that module), or, with neither, ``num_stages`` cuts between repeated blocks (the children of a
container whose children are named by integers: ``model.layers.N``, ``transformer.h.N``) and top-level
modules, balanced by the cost model of ``split.cost``. Every node then belongs to the stage of its position; a
value computable from the root inputs and buffers alone (rotary tables, masks, position ids) is made again by
each later stage that reads it when that is cheap; any other value used on a later stage becomes a boundary
value with its metadata taken from the traced node's ``meta["val"]``.

``split`` runs these phases in order: program inputs, gradient flags, stage boundaries, recomputation,
boundary values, stage graphs, unused state.
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from tracepp.runtime.markers import PIPE_SPLIT_OP
from tracepp.runtime.shapes import activation_key
from tracepp.split import buffer_writes, cost, naming, rules
from tracepp.split.pipeline_graph import (BoundaryValue, PipelineGraph, RootInput, Stage, StateRef,
                                          TensorMeta)


class SplitError(ValueError):
    """The requested split cannot be made."""


# A value computable from the roots is made again by a stage that reads it when that costs at most this many
# FLOPs per byte it would otherwise receive: a device computes thousands of FLOPs in the time a link moves a
# byte, and a recomputed value also needs no buffer, tag or wait.
RECOMPUTE_FLOPS_PER_BYTE = 100


STATE_FQN = "tracepp_fqn"  # stage placeholder meta: the FQN (of a tied weight: the alias) the stage reads it by

_STATE_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                InputKind.CONSTANT_TENSOR: "constant"}


@functools.lru_cache(maxsize=65536)  # every node of a layer names the same few paths: each is normalised once
def module_path(raw: str) -> str:
    """Normalise an nn_module_stack path to the FQN ``named_modules()`` uses.

    torch 2.13's export (strict or not) already records "model.layers.1"; dynamo-style spellings
    ("L['self'].model.layers[1]", "L['self']._modules['model']._modules['layers']['1']") are mapped too.
    """
    raw = re.sub(r"^L\['self'\]", "", raw)
    raw = re.sub(r"\.?_modules\['([^']+)'\]", r".\1", raw)
    raw = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", raw)
    return _SLICED.sub(_unslice, raw).strip(".")


# a module list sliced where a module is shared (torch's module-stack tracer then names paths as they are reached:
# PEFT's VeRA, whose every layer holds one buffer dict, under Llama's ``self.layers[:num_hidden_layers]``)
_SLICED = re.compile(r"\.slice\((\w+), (\w+), (\w+)\)\.(\d+)")


def _unslice(match) -> str:
    start, _stop, step, index = match.groups()
    first = 0 if start == "None" else int(start)
    stride = 1 if step == "None" else int(step)
    return f".{first + stride * int(index)}"


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
    paths = [path for path in node_modules(node) if path and not path.startswith("_empty_nn_module_stack")]
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


def repeated_blocks(model: torch.nn.Module) -> set:
    """FQNs of the children of every repeated-block container: a module whose children are all named by
    integers ("model.layers" -> "model.layers.0", "model.layers.1", ...; also "transformer.h.N", "blocks.N",
    "encoder.layer.N")."""
    blocks = set()
    for fqn, module in model.named_modules():
        names = [name for name, _child in module.named_children()]
        if names and all(name.isdigit() for name in names):
            blocks.update(f"{fqn}.{name}" if fqn else name for name in names)
    return blocks


def segment_key(modules: list, blocks: set) -> str:
    """The segment a node belongs to for automatic cuts: the outermost repeated block on its module path
    ("model.layers.3"), else the top-level child it runs in ("model" for a wrapper, "lm_head")."""
    for path in modules:
        if path in blocks:
            return path
    return modules[1] if len(modules) > 1 else (modules[0] if modules else "")


def segment_starts(keys: list) -> list:
    """Positions where the segment key changes (a possible cut before each)."""
    return [position for position in range(1, len(keys)) if keys[position] != keys[position - 1]]


def _node_costs(nodes: list, flops: dict, needs_grad: dict, counted_state: set) -> cost.SegmentCost:
    """The summed cost of nodes: their FLOPs, the parameters they read (each once), the activations they make."""
    total = cost.SegmentCost()
    seen = set()
    for node in nodes:
        total.forward_flops += flops.get(node.name, 0)
        for arg in node.all_input_nodes:
            if arg.name in counted_state and arg.name not in seen:
                seen.add(arg.name)
                val = arg.meta.get("val")
                total.num_params += val.numel() if isinstance(val, torch.Tensor) else 0
                total.param_bytes += cost.held_bytes(arg)
        val = node.meta.get("val")
        if needs_grad.get(node) and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            total.activation_bytes += cost.tensor_bytes(val)
    return total


SEGMENT = "tracepp_segment"  # node meta: the index of the segment (segment_table's row) the node belongs to


def segment_table(nodes: list, model: torch.nn.Module, flops: dict, needs_grad: dict, parameters: set,
                  computable: set, stage_of: Optional[dict] = None, per_segment=None, experts=None) -> list:
    """The pieces a re-split may cut between, as plain data: the automatic balancer's segments (repeated blocks,
    top-level modules), each beginning at a module a split point can name, in execution order.

    Per segment, for the traced microbatch: ``begins`` (the split point FQN that starts it; None for the first),
    ``forward_flops``, ``num_params``, ``param_bytes``, ``activation_bytes`` (as ``split.cost``), and what a cut
    before it would send: ``cut_tensors``/``cut_bytes`` (tensor values made before, used at or after it; values a
    later stage can make again from the inputs are left out) and ``cut_grad_tensors``/``cut_grad_bytes`` (those
    that carry a gradient back); ``stage``: the stage its first node is on in this split (``stage_of``, when
    given); ``tp``: ``per_segment(its nodes, the values crossing the cut before it)`` where given
    (``split.tensor_parallel.segment_figures``: what tensor parallelism would shard and add); ``ep``:
    ``experts(its nodes)`` where given and not empty (``split.expert_parallel.expert_figures``: its routed experts'
    parameters, FLOPs and (token, expert) rows, for ``--ep-sizes``). A segment whose start no module names is
    merged into the one before it.
    """
    blocks = repeated_blocks(model)
    keys = [segment_key(node_modules(node), blocks) for node in nodes]
    position = {node: index for index, node in enumerate(nodes)}
    first_in: dict = {}
    for index, node in enumerate(nodes):
        for path in node_modules(node):
            first_in.setdefault(path, index)
    starts = [p for p in segment_starts(keys) if keys[p] and first_in.get(keys[p]) == p]
    edges = [0] + starts + [len(nodes)]
    last_use: dict = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in position:
                last_use[arg] = max(last_use.get(arg, -1), position[node])
    for node in nodes:  # values the model returns cross every later cut into the last stage
        if any(user.op == "output" for user in node.users):
            last_use[node] = len(nodes)
    table = []
    for index, (start, end) in enumerate(zip(edges, edges[1:])):
        for node in nodes[start:end]:  # stage graphs copy it: the memory count gives each segment its bytes
            node.meta[SEGMENT] = index
        piece = _node_costs(nodes[start:end], flops, needs_grad, parameters)
        tensors = sent = grad_tensors = grad = 0
        crossing = []
        if index:
            for node in nodes[:start]:
                val = node.meta.get("val")
                if last_use.get(node, -1) < start or not isinstance(val, torch.Tensor) or node in computable:
                    continue
                crossing.append(node)
                tensors += 1
                sent += cost.tensor_bytes(val)
                if needs_grad.get(node) and val.dtype.is_floating_point:
                    grad_tensors += 1
                    grad += cost.tensor_bytes(val)
        table.append({"begins": keys[start] if index else None, "forward_flops": piece.forward_flops,
                      "num_params": piece.num_params, "param_bytes": piece.param_bytes,
                      "activation_bytes": piece.activation_bytes, "cut_tensors": tensors, "cut_bytes": sent,
                      "cut_grad_tensors": grad_tensors, "cut_grad_bytes": grad,
                      "stage": stage_of.get(nodes[start]) if stage_of is not None and start < len(nodes) else None})
        if per_segment is not None:
            table[-1]["tp"] = per_segment(nodes[start:end], crossing)
        if experts is not None:
            found = experts(nodes[start:end])
            if found:
                table[-1]["ep"] = found
    return table


def _balanced_boundaries(nodes: list, num_stages: int, model: torch.nn.Module, flops: dict, needs_grad: dict,
                         parameters: set, memory_of) -> list:
    """Cuts between segments (repeated blocks, else top-level modules) that balance FLOPs, then memory."""
    blocks = repeated_blocks(model)
    keys = [segment_key(node_modules(node), blocks) for node in nodes]
    starts = segment_starts(keys)
    if len(starts) < num_stages - 1:
        raise SplitError(
            f"cannot make {num_stages} stages: the model has only {len(starts) + 1} segments (repeated blocks "
            f"and top-level modules); use fewer stages or mark cuts with pipe_split()"
        )
    edges = [0] + starts + [len(nodes)]
    segments = [_node_costs(nodes[a:b], flops, needs_grad, parameters) for a, b in zip(edges, edges[1:])]
    cuts = cost.choose_cuts(segments, num_stages, memory_of)
    return [edges[segment] for segment in cuts]


# -- the phases of split() ----------------------------------------------------------------------------------

def _check_no_buffer_mutation(signature) -> None:
    if signature.buffers_to_mutate:
        names = ", ".join(sorted(signature.buffers_to_mutate.values()))
        raise SplitError(f"the model mutates buffers in forward ({names}), e.g. BatchNorm running statistics; "
                         "tracepp does not pipeline buffer mutation yet: use LayerNorm/GroupNorm or eval-mode "
                         "statistics")


@dataclass
class _ProgramInputs:
    state: dict  # placeholder name -> StateRef
    root_inputs: dict  # placeholder name -> RootInput
    fqn_to_tensor: dict
    symbol_names: dict  # export's sympy symbol -> ours
    symbols: dict  # our symbol name -> range and source
    batch_symbol: Optional[str]


def _program_inputs(traced, node_by_name: dict) -> _ProgramInputs:
    """The program's inputs: state (params, buffers, constants, with every alias FQN) and the batch's leaves."""
    program = traced.program
    aliases: dict = {}
    for fqn, tensor in list(traced.model.named_parameters(remove_duplicate=False)) + list(
            traced.model.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(tensor), []).append(fqn)
    fqn_to_tensor = dict(traced.model.named_parameters(remove_duplicate=False))
    fqn_to_tensor.update(traced.model.named_buffers(remove_duplicate=False))

    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    state: dict = {}
    root_inputs: dict = {}
    leaf_paths = _leaf_paths(program.call_spec.in_spec)
    user_index = 0
    for node, spec in zip(placeholders, program.graph_signature.input_specs):
        if spec.kind in _STATE_KINDS:
            fqn = spec.target
            tensor = fqn_to_tensor.get(fqn)
            names = aliases.get(id(tensor), [fqn]) if tensor is not None else [fqn]
            state[node.name] = StateRef(node.name, fqn, sorted(names), _STATE_KINDS[spec.kind],
                                        persistent=spec.persistent is not False,
                                        trainable=getattr(tensor, "requires_grad", True))
        elif spec.kind == InputKind.USER_INPUT:
            root_inputs[node.name] = RootInput(node.name, user_index, leaf_paths[user_index],
                                               traced.batched_leaves[user_index], None)
            user_index += 1
        else:
            raise SplitError(f"unsupported program input '{node.name}' of kind {spec.kind.name}")
    names, symbols = _root_symbols(program, [(node_by_name[r.placeholder], r) for r in root_inputs.values()],
                                   getattr(traced, "dim_names", {}))
    for root in root_inputs.values():
        val = node_by_name[root.placeholder].meta.get("val")
        if isinstance(val, torch.Tensor):
            root.meta = tensor_meta(val, False, names)
    dim = getattr(traced, "batch_dim", 0)
    batch_symbol = next((r.meta.shape[dim] for r in root_inputs.values()
                         if r.batched and r.meta is not None and isinstance(r.meta.shape[dim], str)), None)
    return _ProgramInputs(state, root_inputs, fqn_to_tensor, names, symbols, batch_symbol)


def _gradient_flags(graph: fx.Graph, trainable: set) -> dict:
    """Which values need a gradient, as autograd decides: downstream of a trainable parameter through an operand
    whose gradient the op takes, and floating (or complex). ``type_as`` takes only its first operand's (the second
    gives a dtype: OLMo-core's ``pos_sin.type_as(q)`` is not made to carry one); a tensor made like another
    (``zeros_like``, ``x.new_empty``) and an integer or bool result (a comparison, an index) carry none."""
    needs_grad: dict = {}
    views: dict = {}  # a value -> the views of it made so far (what an in-place write into one of them changes)
    for node in graph.nodes:
        if node.op == "placeholder":
            needs_grad[node] = node.name in trainable
        elif node.target is torch.ops.aten.detach.default or node.target in rules.LIKE or node.target in rules.FRESH:
            needs_grad[node] = False  # detach: e.g. the outputs of an inlined no_grad block
        elif node.target is torch.ops.aten.type_as.default:
            needs_grad[node] = needs_grad.get(node.args[0], False)
        elif node.op != "output":
            val = node.meta.get("val")
            exact = isinstance(val, torch.Tensor) and not (val.dtype.is_floating_point or val.dtype.is_complex)
            needs_grad[node] = not exact and any(needs_grad.get(arg, False) for arg in node.all_input_nodes)
        if node.op != "call_function":
            continue
        root = _grad_root(node)
        if root is not node:
            views.setdefault(root, []).append(node)
        if needs_grad[node]:  # a value that carries a gradient written into a tensor made without one (DeepSeek-V4's
            #                   compressor: new_gate[:, 1:, :ratio] = chunk_gate[...] into a new_full): from here
            #                   on, autograd has it and its views carry one
            for written_root in (_grad_root(arg) for arg in rules.written(node) if isinstance(arg, fx.Node)):
                if not needs_grad.get(written_root, True):
                    for value in [written_root] + views.get(written_root, []):
                        needs_grad[value] = True
    return needs_grad


def _grad_root(node):
    """The tensor an in-place write into ``node`` gives a gradient to (``rules.view_root``, not through a
    ``detach``)."""
    return rules.view_root(node, through_detach=False)


def _stage_boundaries(traced, compute: list, split_points: Optional[list], num_stages: Optional[int],
                      default_stages: int, balance) -> tuple:
    """(compute nodes without markers, positions where stages 1.. begin): from pipe_split() markers, else
    split points, else ``balance(nodes, count)``."""
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
        boundaries = balance(compute, wanted) if wanted > 1 else []
    edges = [0] + boundaries + [len(compute)]
    for index in range(len(boundaries) + 1):
        if edges[index + 1] <= edges[index]:
            raise SplitError(f"stage {index} would be empty: two split points fall at the same place in the graph")
    return compute, boundaries


def _computable_from_roots(compute: list, state: dict, needs_grad: dict, written=frozenset()) -> set:
    """Nodes whose value follows from root inputs, buffers and constants alone, deterministically and without
    a gradient (rotary tables, masks, position ids): a stage can make them itself instead of receiving them. A
    buffer written in place (``written``: ``buffer_writes``) is no such root: only its writer's stage holds it."""
    computable = set()
    for node in compute:
        if node.op != "call_function" or needs_grad.get(node):
            continue
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        if all(arg in computable or (arg.op == "placeholder" and arg not in written and
                                     (arg.name not in state or state[arg.name].kind != "parameter"))
               for arg in node.all_input_nodes):
            computable.add(node)
    return computable


def _ancestors_within(node: fx.Node, allowed: set, local: set) -> list:
    """The nodes of ``allowed`` not in ``local`` that ``node`` depends on (itself included)."""
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in found or current in local or current not in allowed:
            continue
        found.add(current)
        stack.extend(current.all_input_nodes)
    return list(found)


def _place_recomputation(compute: list, edges: list, computable: set, flops: dict) -> tuple:
    """Each stage's node list (its own nodes, plus copies of earlier values it makes again rather than receive)
    and {node: [stages that recompute it]}. A value is recomputed when it is computable from the roots and its
    missing sub-graph costs at most RECOMPUTE_FLOPS_PER_BYTE FLOPs per byte it would otherwise send."""
    position = {node: index for index, node in enumerate(compute)}
    stage_nodes, recomputed = [], {}
    for index in range(len(edges) - 1):
        own = set(compute[edges[index]:edges[index + 1]])
        local = set(own)
        for node in compute[edges[index]:edges[index + 1]]:
            for arg in node.all_input_nodes:
                if arg in local or arg not in computable or not isinstance(arg.meta.get("val"), torch.Tensor):
                    continue
                missing = _ancestors_within(arg, computable, local)
                work = sum(flops.get(n.name, 0) for n in missing)
                if work <= RECOMPUTE_FLOPS_PER_BYTE * cost.tensor_bytes(arg.meta["val"]):
                    local.update(missing)
                    recomputed.setdefault(arg, []).append(index)
        stage_nodes.append(sorted(local, key=position.__getitem__))
    return stage_nodes, recomputed


def _crossing(compute: list, stage_nodes: list, recomputed: dict, output_node: fx.Node,
              model: torch.nn.Module) -> set:
    """The values worth a readable name: those that leave their segment (a repeated block or a top-level
    module), are read on a stage other than their own or made again there, or are model outputs."""
    blocks = repeated_blocks(model)
    segment = {node: segment_key(node_modules(node), blocks) for node in compute}
    crossing = {leaf for leaf in output_node.args[0] if isinstance(leaf, fx.Node)}
    for node in compute:
        if any(user.op != "output" and segment.get(user) != segment[node] for user in node.users):
            crossing.add(node)
    for nodes in stage_nodes:
        local = set(nodes)
        crossing.update(arg for node in nodes for arg in node.all_input_nodes if arg not in local)
    crossing.update(recomputed)
    return {node for node in crossing if node.op != "placeholder"}


def _boundary_values(stage_nodes: list, stage_of: dict, output_node: fx.Node, inputs: _ProgramInputs,
                     needs_grad: dict, names: dict) -> tuple:
    """Values that cross stages: (tensor values, size values, output leaves), keyed by their readable names
    (``names``, see ``split.naming``). Sets each input's ``stages``."""
    last = len(stage_nodes) - 1
    used_on: dict = {}  # node -> stages that read it without making it
    for index, nodes in enumerate(stage_nodes):
        local = set(nodes)
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in local:
                    used_on.setdefault(arg, set()).add(index)
    output_leaves = []
    last_local = set(stage_nodes[last])
    for leaf in output_node.args[0]:
        if isinstance(leaf, fx.Node):
            if leaf not in last_local:
                used_on.setdefault(leaf, set()).add(last)
            output_leaves.append(("value", names.get(leaf, leaf.name)))
        else:
            output_leaves.append(("const", leaf))

    values: dict = {}
    sym_values: dict = {}  # name -> (producer, consumers, python expression)
    for node, stages in used_on.items():
        if node.op == "placeholder":
            ref = inputs.state.get(node.name) or inputs.root_inputs.get(node.name)
            ref.stages = sorted(stages)
            continue
        later = sorted(stages)
        val = node.meta.get("val")
        name = names.get(node, node.name)
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            # a size (e.g. `T = idx.shape[1]` used by every layer): each consumer evaluates it from the
            # step's root symbols instead of receiving it
            sym_values[name] = (stage_of[node], later, dim_text(val, inputs.symbol_names))
            continue
        if not isinstance(val, torch.Tensor):
            raise SplitError(
                f"value '{node.name}' ({type(val).__name__}) made on stage {stage_of[node]} is used on stage(s) "
                f"{later}; only tensors may cross a stage boundary: move the split point so that "
                f"{_describe(node)} and its users fall on one stage"
            )
        values[name] = BoundaryValue(name, stage_of[node], later, tensor_meta(val, needs_grad[node], inputs.symbol_names))
    return values, sym_values, output_leaves


def _build_stage(index: int, nodes: list, own: list, inputs: _ProgramInputs, values: dict, sym_values: dict,
                 output_leaves: list, node_by_name: dict, is_last: bool, names: dict) -> Stage:
    """One stage's fx graph: placeholders for its state, root inputs, received values and sizes; its nodes.

    ``node_by_name`` finds a node by its traced or its readable name; ``names`` gives the readable names of the
    values that leave a block or module or cross stages, which their copies here take."""
    stage_graph = fx.Graph()
    env: dict = {}
    stage_state = [name for name, ref in inputs.state.items() if index in ref.stages]
    stage_roots = [name for name, ref in inputs.root_inputs.items() if index in ref.stages]
    received = sorted((value.producer, name) for name, value in values.items() if index in value.consumers)
    local = set(nodes)
    for name in stage_state + stage_roots:
        original = node_by_name[name]
        ref = inputs.state.get(name)
        fqn = _owner_alias(ref, original, local) if ref is not None else None
        env[original] = stage_graph.placeholder(_state_placeholder(name, ref, fqn) if ref is not None else name)
        env[original].meta = dict(original.meta)
        if fqn is not None:
            env[original].meta[STATE_FQN] = fqn
    for producer, name in received:
        original = node_by_name[name]
        env[original] = stage_graph.placeholder(activation_key(name, producer))
        env[original].meta = {"val": original.meta.get("val")}
    stage_sym_inputs = []
    for name, (_producer, consumers, expr) in sym_values.items():
        if index in consumers:
            original = node_by_name[name]
            env[original] = stage_graph.placeholder(name)
            env[original].meta = {"val": original.meta.get("val")}
            stage_sym_inputs.append((name, expr))
    for node in nodes:
        env[node] = stage_graph.node_copy(node, lambda n: env[n])
        if node in names:
            env[node]._rename(names[node])
    modules_seen: list = []
    for node in own:
        fqn = listed_module(node)
        if fqn and fqn not in modules_seen:
            modules_seen.append(fqn)
    if is_last:
        outputs = [name for kind, name in output_leaves if kind == "value"]
        result = tuple(env[node_by_name[leaf]] if kind == "value" else leaf for kind, leaf in output_leaves)
    else:
        outputs = [name for name, value in values.items() if value.producer == index]
        result = tuple(env[node_by_name[name]] for name in outputs)
    stage_graph.output(result)
    stage_graph.lint()
    return Stage(index, stage_graph, stage_state, stage_roots, received, outputs, modules_seen, stage_sym_inputs)


def _owner_alias(ref: StateRef, original: fx.Node, local: set) -> str:
    """The FQN by which this stage reads a state tensor: of a tied weight, the alias whose module runs here
    (the embedding's name in the first stage, the head's in the last), else the FQN export recorded."""
    if len(ref.aliases) < 2:
        return ref.fqn
    modules = {path for user in original.users if user in local for path in node_modules(user)}
    for alias in [ref.fqn] + ref.aliases:
        if alias.rpartition(".")[0] in modules:
            return alias
    return ref.fqn


def _state_placeholder(name: str, ref: StateRef, fqn: str) -> str:
    """export's placeholder name (``p_head_weight``), or for a tied weight the one of the alias this stage
    reads it by (``p_embed_weight`` in the embedding's stage)."""
    if fqn == ref.fqn:
        return name
    prefix = name.split("_", 1)[0] + "_" if name[:2] in ("p_", "b_", "c_") else ""
    return prefix + fqn.replace(".", "_")


def _unused_state(traced, inputs: _ProgramInputs) -> dict:
    """FQN -> tensor of the state no stage reads (kept for --save); drops unused alias placeholders (the tied
    copy export left behind) from ``inputs.state``. The state is what the model's modules hold (``held_state``),
    not what a state_dict hook saves in its place (torchtitan's fused qkv saves ``wq``/``wk``/``wv`` cut from the
    ``wqkv`` the stages read)."""
    from tracepp.runtime.weights import held_state

    used_ids = {id(inputs.fqn_to_tensor.get(ref.fqn)) for ref in inputs.state.values() if ref.stages}
    unused = {}
    for fqn, tensor in held_state(traced.model).items():
        if id(tensor) not in used_ids:
            unused[fqn] = tensor.detach().clone()
    for name, ref in list(inputs.state.items()):
        if not ref.stages:
            del inputs.state[name]
    return unused


def _tensor_parallel_figures(graph, inputs, flops: dict, needs_grad: dict, sizes: tuple, begins: dict = None):
    """``segment_table``'s per-segment tensor-parallel figures at each tp of ``sizes`` (the tuner's
    ``--tp-sizes``), or None where the whole graph cannot be walked."""
    from tracepp.split import tensor_parallel

    fqn_of = {name: ref.fqn for name, ref in inputs.state.items() if ref.kind == "parameter"}
    try:
        sequence = tensor_parallel.whole_graph_sequence(graph, inputs.root_inputs)
        walks = tensor_parallel.whole_graph_walks(graph, fqn_of, needs_grad, sizes=sizes, sequence=sequence,
                                                  begins=begins)
    except Exception:  # an op the walk does not expect: no tp figures, the split goes on
        return None
    return lambda nodes, crossing=(): tensor_parallel.segment_figures(nodes, walks, flops, cost.tensor_bytes,
                                                                      crossing)


def _context_parallel_figures(graph, compute: list, segments: list, inputs, flops: dict, needs_grad: dict,
                              computable: set) -> None:
    """Each segment's context-parallel figures (``segments[k]["cp"]``, the tuner's ``--cp-sizes``); none where
    the whole graph cannot be walked."""
    from tracepp.split import context_parallel

    fqn_of = {name: ref.fqn for name, ref in inputs.state.items() if ref.kind == "parameter"}
    try:
        context_parallel.segment_figures(graph, compute, segments, inputs.root_inputs, fqn_of, needs_grad, flops,
                                         computable, cost.tensor_bytes)
    except Exception:  # an op the walk does not expect: no cp figures, the split goes on
        for seg in segments:
            seg.pop("cp", None)


def _expert_figures(graph, inputs, flops: dict):
    """``segment_table``'s per-segment routed-expert figures (the tuner's ``--ep-sizes``), or None where the
    graph's blocks cannot be read."""
    from tracepp.split import expert_parallel

    fqn_of = {name: ref.fqn for name, ref in inputs.state.items() if ref.kind == "parameter"}
    try:
        return expert_parallel.expert_figures(graph, fqn_of, flops)
    except Exception:  # an unexpected graph: no ep figures, the split goes on
        return None


def split(traced, split_points: Optional[list] = None, num_stages: Optional[int] = None,
          default_stages: int = 1, schedule: Optional[str] = None, num_microbatches: int = 1,
          training: bool = True) -> PipelineGraph:
    """Cut at markers, else at ``split_points``, else into ``num_stages or default_stages`` stages balanced by
    the cost model (FLOPs, then memory under ``schedule`` with ``num_microbatches`` in flight)."""
    program = traced.program
    graph = program.graph
    _check_no_buffer_mutation(program.graph_signature)
    node_by_name = {n.name: n for n in graph.nodes}
    inputs = _program_inputs(traced, node_by_name)
    written = buffer_writes.written_buffers(graph, inputs.state)
    pins = buffer_writes.read_after_writes(graph, written)  # later stages receive what a stage wrote into a buffer
    node_by_name.update({n.name: n for n in pins})
    trainable = {name for name, ref in inputs.state.items() if ref.kind == "parameter" and ref.trainable}
    needs_grad = _gradient_flags(graph, trainable)
    if training:
        buffer_writes.check_gradients(written, needs_grad)
    counted = cost.count_flops(graph)
    flops = counted.by_node
    parameters = {name for name, ref in inputs.state.items() if ref.kind == "parameter"}

    def balance(nodes: list, count: int) -> list:
        def memory_of(stage_index: int, stage_cost: cost.SegmentCost) -> int:
            inflight = cost.inflight_microbatches(schedule, stage_index, count, num_microbatches, training)
            return cost.stage_estimate(stage_cost, inflight, training)["memory_bytes"]
        return _balanced_boundaries(nodes, count, traced.model, flops, needs_grad, parameters, memory_of)

    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    compute, boundaries = _stage_boundaries(traced, compute, split_points, num_stages, default_stages, balance)
    boundaries = buffer_writes.pin(compute, boundaries, pins)
    edges = [0] + boundaries + [len(compute)]
    count = len(edges) - 1
    stage_of = {node: index for index in range(count) for node in compute[edges[index]:edges[index + 1]]}
    buffer_writes.check_reads(written, stage_of)
    computable = _computable_from_roots(compute, inputs.state, needs_grad, set(written))
    stage_nodes, recomputed = _place_recomputation(compute, edges, computable, flops)
    try:
        segments = segment_table(compute, traced.model, flops, needs_grad, parameters, computable, stage_of)
    except Exception:  # the table only serves the tuner: never fail a split for it
        segments = []
    output_node = next(n for n in graph.nodes if n.op == "output")
    names = naming.value_names(graph, _crossing(compute, stage_nodes, recomputed, output_node, traced.model),
                               inputs.symbol_names)
    node_by_name.update({name: node for node, name in names.items()})
    values, sym_values, output_leaves = _boundary_values(stage_nodes, stage_of, output_node, inputs, needs_grad,
                                                         names)

    stages = []
    for index in range(count):
        stage = _build_stage(index, stage_nodes[index], compute[edges[index]:edges[index + 1]], inputs, values,
                             sym_values, output_leaves, node_by_name, index == count - 1, names)
        inflight = cost.inflight_microbatches(schedule, index, count, num_microbatches, training)
        stage.estimate = cost.stage_estimate(_node_costs(stage_nodes[index], flops, needs_grad, parameters),
                                             inflight, training)
        stages.append(stage)
    unused_state = _unused_state(traced, inputs)
    result = PipelineGraph(stages, values, inputs.state, inputs.root_inputs, len(traced.batched_leaves),
                         program.call_spec.in_spec, program.call_spec.out_spec, output_leaves,
                         unused_state, inputs.symbols, inputs.batch_symbol,
                         {str(k): str(v) for k, v in inputs.symbol_names.items()},
                         {names.get(node, node.name): {
                             "producer": stage_of[node], "stages": where,
                             **tensor_meta(node.meta["val"], False, inputs.symbol_names).to_json()}
                          for node, where in recomputed.items()}, segments, counted.record(), counted.warnings())
    result.batch_dim = getattr(traced, "batch_dim", 0)
    # what tuner_figures needs of the whole traced graph, kept in memory only (never written)
    result.whole = _Whole(traced.model, graph, inputs, flops, needs_grad, parameters, compute, computable, stage_of)
    return result


@dataclass
class _Whole:
    """The whole traced graph as the split read it: what :func:`tuner_figures` walks."""

    model: torch.nn.Module
    graph: fx.Graph
    inputs: object
    flops: dict
    needs_grad: dict
    parameters: set
    compute: list
    computable: set
    stage_of: dict


def tuner_figures(pipeline_graph, tp_sizes=(), cp: bool = False, ep: bool = False) -> list:
    """The segment table with the figures ``plan --tune`` prices other layouts from, computed only when asked:
    ``tp`` per size in ``tp_sizes`` (``split.tensor_parallel.segment_figures``), ``cp`` (context parallel,
    ``split.context_parallel.segment_figures``) and ``ep`` (routed experts, ``split.expert_parallel``). A split
    computes none of them (they walk the whole graph: minutes on a 671B model); the tuner asks for the ones its
    ``--tp-sizes``, ``--cp-sizes`` and ``--ep-sizes`` need and caches them in the folder."""
    whole = pipeline_graph.whole
    begins = {index: seg.get("begins") for index, seg in enumerate(pipeline_graph.segments or [])}
    per_segment = (_tensor_parallel_figures(whole.graph, whole.inputs, whole.flops, whole.needs_grad,
                                            tuple(tp_sizes), begins) if tp_sizes else None)
    experts = _expert_figures(whole.graph, whole.inputs, whole.flops) if ep else None
    segments = segment_table(whole.compute, whole.model, whole.flops, whole.needs_grad, whole.parameters,
                             whole.computable, whole.stage_of, per_segment, experts)
    if cp:
        _context_parallel_figures(whole.graph, whole.compute, segments, whole.inputs, whole.flops,
                                  whole.needs_grad, whole.computable)
    return segments


def _describe(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    where = trace[-2].strip() if len(trace) >= 2 else ""
    return f"'{node.name}' ({where})" if where else f"'{node.name}'"
