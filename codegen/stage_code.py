"""Python source of a rank's stage functions (and the block functions they call), from torch.fx's own code
generator.

A stage function takes the stage's parameters/buffers, its root inputs, its received values and the sizes it
reads (in the manifest's order) and returns the values it sends on (the last stage: the model's output
leaves). Each is printed by ``Graph.python_code`` with a ``CodeGen`` subclass set by ``Graph.set_codegen``
(:class:`FunctionCodeGen`: the function's name, one parameter per line); fx writes the shape annotations
(``"f32[s_batch, s_seq, 64]"``) and a ``# File: model.py:42 in forward, code: ...`` comment per source line.
Everything else is decided on the graph before fx prints it:

* names: node names come from ``split`` (values leaving a block or module, crossing stages:
  ``layers_5_out``, ``rotary_emb_cos``; received ones ``..._from_stage0``), chosen through one namespace;
* shapes: export's symbols (``s95``) are replaced by the root symbols (``s_batch``) in the metadata fx reads
  for annotations (:func:`_name_symbols`);
* provenance: each node's stack trace is trimmed to the model's own frames and its file paths made relative
  (``model.py``, ``transformers/models/llama/modeling_llama.py``), so the comments survive copying the folder;
* blocks (``model.layers.N``, ``transformer.h.N``) become functions: those whose traced graphs are the same share
  one, printed by fx from the first block's nodes and called once per block (:func:`find_blocks`); activation
  checkpointing recomputes a stage one block call at a time.
"""
from __future__ import annotations

import copy
import dis
import functools
import operator
import os
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from tracepp.split import naming
from tracepp.split.rules import drop_metadata_asserts
from tracepp.split.partition import STATE_FQN, module_path
from tracepp.split.pipeline_graph import Stage

_TORCH_DIR = os.path.dirname(torch.__file__)

RUN_DEVICE = "RUN_DEVICE"  # the rank script's global naming this rank's device; the runtime sets it
ONE_LINE_SIGNATURE = 110  # a longer ``def f(a: "f32[2]", ...):`` gets one parameter per line


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


class FunctionCodeGen(fx.graph.CodeGen):
    """fx's code generator, printing ``def <name>(...)`` (one parameter per line when long) and calls of the
    given block functions by their own names."""

    def __init__(self, function_name: str, functions: Optional[dict] = None):
        super().__init__()
        self.function_name = function_name
        self.functions = dict(functions or {})  # printed name -> the call target standing for it

    def gen_fn_def(self, free_vars: list, maybe_return_annotation: str, *args, **kwargs) -> str:
        one_line = f"def {self.function_name}({', '.join(free_vars)}){maybe_return_annotation}:"
        if len(one_line) <= ONE_LINE_SIGNATURE:
            return one_line
        params = "".join(f"    {var},\n" for var in free_vars)
        return f"def {self.function_name}(\n{params}){maybe_return_annotation}:"

    def _gen_python_code(self, nodes, root_module, namespace, *args, **kwargs):
        # fx names a called function after its module (``tracepp_generated_block``); naming the target in
        # fx's per-source namespace first makes fx print (and list among the globals) the block's own name
        for name, target in self.functions.items():
            namespace.create_name(name, target)
        return super()._gen_python_code(nodes, root_module, namespace, *args, **kwargs)


# -- graph passes on a stage's copy ---------------------------------------------------------------------------

def _autocast_off_regions(graph: fx.Graph) -> None:
    """Nodes traced inside ``torch.autocast(enabled=False)`` (marked by the trace step) run with autocast off
    again: ``torch.amp._enter_autocast`` before each run of them and ``_exit_autocast`` after, as export's own
    pre-dispatch graphs do. Without it, ``--precision bf16`` would compute HF's rotary tables in bf16. The
    enter/exit nodes take the module path and source line of the region's first/last node, so they stay in
    that block and under that comment."""
    from tracepp.split.pipeline_graph import AUTOCAST_OFF

    region, previous = None, None
    for node in list(graph.nodes):
        marked = bool(node.meta.get(AUTOCAST_OFF))
        if marked and region is None:
            with graph.inserting_before(node):
                region = graph.call_function(torch.amp._enter_autocast, (_RunDeviceType(), None, False, None))
            _take_place(region, node)
        elif not marked and region is not None:
            with graph.inserting_before(node):
                _take_place(graph.call_function(torch.amp._exit_autocast, (region,)), previous)
            region = None
        previous = node


def _take_place(node: fx.Node, of: fx.Node) -> None:
    for key in ("nn_module_stack", "stack_trace"):
        if of.meta.get(key) is not None:
            node.meta[key] = of.meta[key]


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


_LIBRARY_DIRS = sorted({path for path in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"))
                        if path}, key=len, reverse=True)


def _short_path(path: str, model_dir: str) -> str:
    """The model file's folder and installed libraries drop out of a frame's path: ``model.py``,
    ``transformers/models/llama/modeling_llama.py`` (true on any node the folder is copied to)."""
    if model_dir and path.startswith(model_dir + os.sep):
        return os.path.relpath(path, model_dir)
    for library in _LIBRARY_DIRS:
        if path.startswith(library + os.sep):
            return os.path.relpath(path, library)
    for marker in ("site-packages", "dist-packages"):
        if f"{os.sep}{marker}{os.sep}" in path:
            return path.split(f"{os.sep}{marker}{os.sep}", 1)[1]
    return path


@functools.lru_cache(maxsize=4096)  # a model's repeated layers record the same stacks: one per op of a layer
def _readable_trace(trace: str, model_dir: str) -> str:
    trace = _user_stack(trace)
    return re.sub(r'File "([^"]+)"', lambda m: f'File "{_short_path(m.group(1), model_dir)}"', trace)


def prepare(stage: Stage, model_path: str = "") -> fx.Graph:
    """A copy of the stage's graph ready to print: stack traces trimmed and made relative, devices following
    the rank's, export's metadata checks gone, autocast-off regions bracketed. The split result is untouched."""
    model_dir = os.path.dirname(os.path.abspath(model_path)) if model_path else ""
    graph = fx.Graph()
    env: dict = {}
    for node in stage.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])  # meta is copied: edits stay on the copy
        if node.meta.get("stack_trace"):
            env[node].meta["stack_trace"] = _readable_trace(node.meta["stack_trace"], model_dir)
    _follow_run_device(graph)
    drop_metadata_asserts(graph)
    _autocast_off_regions(graph)
    return graph


def _name_symbols(graph: fx.Graph, symbol_aliases: dict) -> None:
    """Make fx annotate with the root symbols (``f32[s_batch, s_seq, 64]``, ``Sym(s_seq + 1)``) instead of
    export's (``s95``): fx prints a tensor's annotation from ``meta["tensor_meta"]`` (a ``TensorMetadata``)
    when there is no ``meta["val"]``, and a size's from the ``SymInt`` in ``meta["val"]``; both get the
    renamed expressions. Only this printing copy is changed."""
    if not symbol_aliases:
        return
    import sympy
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.passes.shape_prop import TensorMetadata

    def rename(expr):
        if not isinstance(expr, sympy.Basic):
            return expr
        return expr.xreplace({s: sympy.Symbol(symbol_aliases[s.name]) for s in expr.free_symbols
                              if s.name in symbol_aliases})

    def dim(size):
        return rename(size.node.expr) if isinstance(size, torch.SymInt) else size

    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in val.shape):
            node.meta["tensor_meta"] = TensorMetadata(tuple(dim(size) for size in val.shape), val.dtype, False, (),
                                                      None, False, {})
            del node.meta["val"]
        elif isinstance(val, torch.SymInt):
            try:
                node.meta["val"] = torch.SymInt(SymNode(rename(val.node.expr), val.node.shape_env, int,
                                                        val.node.hint))
                repr(node.meta["val"])
            except Exception:  # another torch's SymNode: no annotation rather than a wrong one
                del node.meta["val"]


# -- repeated blocks ------------------------------------------------------------------------------------------

def _block_path(node: fx.Node) -> Optional[str]:
    """The outermost numbered module the node runs in (``model.layers.3``), else None."""
    return next((path for path in naming.module_paths(node) if path.rsplit(".", 1)[-1].isdigit()), None)


def _type_text(val) -> str:
    dtype_abbrs = getattr(fx.graph, "dtype_abbrs", {})
    if isinstance(val, torch.Tensor):
        return f"{dtype_abbrs.get(val.dtype, val.dtype)}{list(map(str, val.shape))}"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({val.node.expr})"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_type_text(v) for v in val) + ")"
    return type(val).__name__


def _constant_text(value) -> str:
    # fx prints constants by repr: the same repr means the same printed code
    return repr(value)


@dataclass
class Block:
    """One run of consecutive nodes of one numbered module in a stage's graph."""

    path: str  # "model.layers.3"
    nodes: list
    hoisted: list = field(default_factory=list)  # size arithmetic on outside sizes traced inside it: run before
    inputs: list = field(default_factory=list)  # nodes from outside it read, in first-use order
    outputs: list = field(default_factory=list)  # its nodes read outside it (or returned), in order
    key: tuple = ()  # its structure: equal keys print the same code for their own inputs

    def is_state(self, position: int) -> bool:
        node = self.inputs[position]
        return node.op == "placeholder" and STATE_FQN in node.meta


def _describe(block: Block) -> None:
    index = {node: i for i, node in enumerate(block.nodes)}
    input_index: dict = {}

    def ref(arg):
        if isinstance(arg, fx.Node):
            if arg in index:
                return ("local", index[arg])
            if arg not in input_index:
                input_index[arg] = len(block.inputs)
                block.inputs.append(arg)
            return ("input", input_index[arg])
        return _constant_text(arg)

    structure = []
    for node in block.nodes:
        args = fx.node.map_aggregate(node.args, ref)
        kwargs = fx.node.map_aggregate(node.kwargs, ref)
        structure.append((node.op, node.target, repr(args), repr(kwargs), _type_text(node.meta.get("val"))))
    members = set(block.nodes)
    block.outputs = [node for node in block.nodes if any(user not in members for user in node.users)]
    kinds = tuple((block.is_state(i), _type_text(node.meta.get("val"))) for i, node in enumerate(block.inputs))
    block.key = (tuple(structure), kinds, tuple(index[node] for node in block.outputs))


def _outside_size(node: fx.Node, run: Block) -> bool:
    """A size computed from sizes known before the run (``seq_len + 1`` traced in the first layer and reused
    by the next ones): Python int arithmetic, so it may run before the block without changing any value."""
    if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.SymInt):
        return False
    inside = set(run.nodes)
    return not any(arg in inside for arg in node.all_input_nodes)


def find_blocks(graph: fx.Graph) -> list:
    """The runs of nodes of numbered modules (``model.layers.N``, ``transformer.h.N``, ``blocks.N``) in a
    stage's graph, each described by its inputs, outputs and structure. A module whose nodes do not form one
    run (something else runs in between) is left out: its code stays inline."""
    runs: list = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        path = _block_path(node)
        if path is not None and runs and runs[-1].path == path:
            if _outside_size(node, runs[-1]):
                runs[-1].hoisted.append(node)
            else:
                runs[-1].nodes.append(node)
        else:
            runs.append(Block(path or "", [node]))
    runs_of = Counter(run.path for run in runs)
    blocks = [run for run in runs if run.path and runs_of[run.path] == 1]
    for block in blocks:
        _describe(block)
    return blocks


@dataclass
class BlockFunction:
    """One function for the blocks that trace to the same graph; printed from the first one's nodes."""

    name: str
    blocks: list  # [Block], in rank order
    target: object = None  # the call target fx prints as ``name``
    order: list = field(default_factory=list)  # input positions in parameter order: activations, then state

    def __post_init__(self):
        first = self.blocks[0]
        count = len(first.inputs)
        self.order = [i for i in range(count) if not first.is_state(i)] + [i for i in range(count) if first.is_state(i)]

        def block_stub(*args):  # stands in for the generated function in the graph fx prints
            raise RuntimeError(f"{self.name} is defined by the generated rank script")

        block_stub.__name__ = block_stub.__qualname__ = self.name
        block_stub.__module__ = "tracepp_generated"
        self.target = block_stub


def _class_name(block: Block) -> str:
    """``llama_decoder_layer`` for a block whose module is a ``LlamaDecoderLayer`` (``gpt2_block``, ...)."""
    for path, kind in (block.nodes[0].meta.get("nn_module_stack") or {}).values():
        if module_path(path) == block.path:
            name = (kind if isinstance(kind, str) else getattr(kind, "__name__", "")).rsplit(".", 1)[-1]
            name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
            return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower() or "block"
    return "block"


def group_blocks(blocks: list, namespace: naming.Namespace) -> list:
    """One :class:`BlockFunction` per block structure: blocks that trace to the same graph share it, and a block
    met once gets its own (activation checkpointing recomputes a stage block by block, so every block is a call
    the runtime can checkpoint)."""
    by_key: dict = {}
    for block in blocks:
        by_key.setdefault(block.key, []).append(block)
    return [BlockFunction(namespace.create(_class_name(members[0])), members) for members in by_key.values()]


def _parameter_names(function: BlockFunction) -> list:
    """Per input position, unique: state by its FQN below the block (``self_attn_q_proj_weight``); a value
    every block reads under one name (a mask, rotary tables, a size; on a V rank each stage has its own copy)
    by that name; a value each block gets its own of (the hidden state) ``hidden``."""
    first = function.blocks[0]
    namespace = naming.Namespace()
    names = []
    for position, node in enumerate(first.inputs):
        if first.is_state(position):
            fqn = node.meta[STATE_FQN]
            candidate = (fqn[len(first.path) + 1:] if fqn.startswith(first.path + ".") else fqn).replace(".", "_")
        elif _is_stream(function, position):
            candidate = "hidden"
        else:
            candidate = _common_name([block.inputs[position].name for block in function.blocks])
        names.append(candidate)
    order = function.order  # activations first: they get the plain names when two would clash
    unique = [None] * len(names)
    for position in order:
        unique[position] = namespace.create(names[position])
    return unique


def _is_stream(function: BlockFunction, position: int) -> bool:
    """Whether the blocks pass their running state (the residual stream) at this input position: each block's
    output feeds the next block of its stage there; or, where no stage holds two of them (a V rank with one
    block per stage), the input is what a block's output is (same dtype and shape)."""
    pairs = [(before, block) for before, block in zip(function.blocks, function.blocks[1:])
             if before.nodes[0].graph is block.nodes[0].graph]
    if pairs:
        return all(block.inputs[position] in before.outputs for before, block in pairs)
    first = function.blocks[0]
    return len(first.outputs) == 1 and \
        _type_text(first.inputs[position].meta.get("val")) == _type_text(first.outputs[0].meta.get("val"))


def _common_name(names: list) -> str:
    """One parameter name for the values the blocks pass at one position: their shared name (each stage of a
    V rank has its own ``rotary_emb_cos``, received ones end in ``_from_stage<k>``), else both names when
    two kinds alternate (``full_attention_or_sliding_attention``, Gemma2's masks), else ``value``."""
    stems = list(dict.fromkeys(re.sub(r"_from_stage\d+$", "", name) for name in names))
    if len(stems) > 1:  # where_1, where: fx's numbering apart, one name
        stems = list(dict.fromkeys(re.sub(r"_\d+$", "", stem) for stem in stems))
    if len(stems) == 1:
        return stems[0]
    return "_or_".join(sorted(stems)) if len(stems) == 2 else "value"


def _copy(graph: fx.Graph, node: fx.Node, env: dict, name: str) -> fx.Node:
    new = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, env.__getitem__),
                            fx.node.map_arg(node.kwargs, env.__getitem__), name=name, type_expr=node.type)
    new.meta = copy.copy(node.meta)
    return new


def block_graph(function: BlockFunction) -> fx.Graph:
    """The first block's nodes as a graph of their own: its inputs as parameters (activations first), its
    outputs returned (``out``), inner values renumbered from the block's start (``linear``, ``linear_1``)."""
    first = function.blocks[0]
    graph = fx.Graph()
    env: dict = {}
    names = _parameter_names(function)
    for position in function.order:
        node = first.inputs[position]
        env[node] = graph.placeholder(names[position])
        env[node].meta = {key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta}
    outputs = set(first.outputs)
    for node in first.nodes:
        name = "out" if node in outputs else re.sub(r"_\d+$", "", node.name)
        env[node] = _copy(graph, node, env, name)
    results = [env[node] for node in first.outputs]
    graph.output(results[0] if len(results) == 1 else tuple(results))
    return graph


def _caller_trace(block: Block) -> Optional[str]:
    """The source line that calls the block (``x = layer(x, seq_len)``): the frames every node of the block
    shares, above the block's own (export records a frame per module level: the root's ``forward`` first),
    up to the last ``forward`` among them."""
    traces = [naming.frames(node.meta.get("stack_trace")) for node in block.nodes]
    traces = [trace for trace in traces if trace]
    if not traces:
        return None
    depth = [module_path(path) for path, _kind in (block.nodes[0].meta.get("nn_module_stack") or {}).values()]
    shared = 0
    while all(len(trace) > shared and trace[shared] == traces[0][shared] for trace in traces):
        shared += 1
    if block.path in depth:
        shared = min(shared, depth.index(block.path))
    if shared == 0:
        return None
    frames = traces[0][:shared]
    last = max((i for i, frame in enumerate(frames) if frame[2] == "forward"), default=shared - 1)
    return "\n".join(f'File "{file}", line {line}, in {function}\n    {code}'
                     for file, line, function, code in frames[:last + 1])


def calling_graph(graph: fx.Graph, functions: list) -> fx.Graph:
    """The stage's graph with each grouped block replaced by one call of its function (its outputs taken from
    the call's result), the rest copied as is."""
    first_node, skipped = {}, set()
    for function in functions:
        for block in function.blocks:
            if block.nodes[0].graph is graph:
                first_node[block.nodes[0]] = (function, block)
                skipped.update(block.nodes[1:] + block.hoisted)
    if not first_node:
        return graph
    calls = fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        if node in skipped:
            continue
        if node not in first_node:
            env[node] = _copy(calls, node, env, node.name)
            continue
        function, block = first_node[node]
        for size in block.hoisted:
            env[size] = _copy(calls, size, env, size.name)
        args = tuple(env[block.inputs[position]] for position in function.order)
        trace = _caller_trace(block)
        if len(block.outputs) == 1:
            (output,) = block.outputs
            call = calls.create_node("call_function", function.target, args, {}, name=output.name)
            call.meta = {key: output.meta[key] for key in ("val",) if key in output.meta}
            env[output] = call
        else:
            call = calls.create_node("call_function", function.target, args, {},
                                     name=naming.short_module_name(block.path))
            for position, output in enumerate(block.outputs):
                item = calls.create_node("call_function", operator.getitem, (call, position), {}, name=output.name)
                item.meta = {key: output.meta[key] for key in ("val",) if key in output.meta}
                if trace:
                    item.meta["stack_trace"] = trace
                env[output] = item
        if trace:
            call.meta["stack_trace"] = trace
    return calls


# -- printing -------------------------------------------------------------------------------------------------

def _print(graph: fx.Graph, function_name: str, symbol_aliases: dict, functions: list) -> tuple:
    """(source, globals it reads) of ``def function_name(...)`` printed by fx."""
    _name_symbols(graph, symbol_aliases)
    targets = {function.name: function.target for function in functions}
    graph.set_codegen(FunctionCodeGen(function_name, targets))
    code = graph.python_code(root_module="self", verbose=True)
    source = _tidy(code.src)
    return source, _globals_read(source, set(code.globals) | set(targets) | {RUN_DEVICE})


def _tidy(source: str) -> str:
    """fx indents the blank line before each ``# File:`` comment and pads the source with blank lines; the
    one text step left, and only on whitespace (the code is fx's)."""
    return "\n".join(line.rstrip() for line in source.strip("\n").splitlines())


def _globals_read(source: str, known: set) -> set:
    return _names_loaded(source) & known


@functools.lru_cache(maxsize=256)  # a block function is printed alike for every rank that calls it
def _names_loaded(source: str) -> frozenset:
    """The global names the function's byte code loads (``_globals_read``: among those fx or we put in its scope)."""
    found, todo = set(), [compile(source, "<stage>", "exec")]
    while todo:
        code = todo.pop()
        found.update(ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        todo.extend(const for const in code.co_consts if hasattr(const, "co_code"))
    return frozenset(found)


@dataclass
class RankCode:
    """A rank script's functions: the block functions (shared by its stages) and one function per stage."""

    blocks: list  # [(BlockFunction, source)]
    stages: list  # [(stage index, source)]
    globals: set
    calls: dict = field(default_factory=dict)  # stage index -> {block function name: calls}, in call order


def rank_code(stages: list, model_path: str = "", symbol_aliases: Optional[dict] = None,
              extract_blocks: bool = True) -> RankCode:
    """``stages``: [(Stage, function name)] of one rank. With ``extract_blocks``, blocks that trace to the same
    graph (on any of the rank's stages) become one function each, called once per block."""
    symbol_aliases = symbol_aliases or {}
    graphs = [(stage, name, prepare(stage, model_path)) for stage, name in stages]
    functions = []
    if extract_blocks:
        namespace = naming.Namespace(["torch", RUN_DEVICE, "main", "boundary_shapes", "os"]
                                     + [name for _stage, name, _graph in graphs])
        functions = group_blocks([block for _s, _n, graph in graphs for block in find_blocks(graph)], namespace)
    used: set = set()
    block_sources = []
    for function in functions:
        source, names = _print(block_graph(function), function.name, symbol_aliases, [])
        block_sources.append((function, source))
        used |= names
    stage_sources, calls = [], {}
    for stage, name, graph in graphs:
        source, names = _print(calling_graph(graph, functions), name, symbol_aliases, functions)
        stage_sources.append((stage.index, source))
        used |= names
        counts = {}
        for function in functions:
            count = sum(1 for block in function.blocks if block.nodes[0].graph is graph)
            if count:
                counts[function.name] = count
        calls[stage.index] = counts
    return RankCode(block_sources, stage_sources, used - {function.name for function in functions}, calls)


def stage_source(stage: Stage, function_name: str, model_path: str = "", symbol_aliases: Optional[dict] = None,
                 extract_blocks: bool = False) -> tuple:
    """(source, globals it needs) of one stage function on its own (no block functions unless asked; then the
    block functions come first in the source)."""
    code = rank_code([(stage, function_name)], model_path, symbol_aliases, extract_blocks)
    parts = [source for _function, source in code.blocks] + [source for _index, source in code.stages]
    return "\n\n\n".join(parts), code.globals


def loss_source(loss, model_path: str = "", symbol_aliases: Optional[dict] = None) -> tuple:
    """(source, globals it needs) of ``loss_forward``: the traced loss function (``--cp``) printed as a stage is."""
    stage = Stage(index=-1, graph=loss.graph, state=[], root_inputs=[], received=[], outputs=[], module_fqns=[])
    return _print(prepare(stage, model_path), "loss_forward", symbol_aliases or {}, [])


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
