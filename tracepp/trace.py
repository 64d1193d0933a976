"""Step 1, trace: run ``torch.export`` on the whole model with one microbatch of the example batch.

Returns a :class:`Traced` record: the ExportedProgram, the model (for parameter aliases), and how the
example batch maps onto the program's inputs. With ``on_meta`` (what ``tracepp split`` uses) the user's plain
``model()`` runs under ``torch.device("meta")``: parameters and buffers get shapes and dtypes but no storage,
so planning a 70B model needs no more memory than its graph; real values enter only at run time
(``runtime/weights.py``). A model whose ``model()`` cannot run on meta (its init reads values) is built for
real instead, with a note saying so. Export failures are re-raised as :class:`TraceError` in the
user's terms: the module and source line that broke the graph, and what to try.
"""
from __future__ import annotations

import contextlib
import operator
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from tracepp.split.pipeline_graph import AUTOCAST_OFF, MASTER_DTYPE
from tracepp import batch_mixing, custom_functions, grad_modes, model_rng, sequence_first
from tracepp.dynamic import DynamicFlags, export_dynamic_shapes, names_from_model_spec
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
    batched_leaves: list  # per flattened (args, kwargs) leaf: is it chunked along the batch dim?
    example_leaves: list = field(default_factory=list)  # flattened full example batch
    dim_names: dict = field(default_factory=dict)  # (leaf index, dim) -> name of a dynamic dim ("seq")
    notes: list = field(default_factory=list)  # things the user should know (printed by the CLI)
    random_ops: list = field(default_factory=list)  # the ops that draw random numbers ("aten.rand_like at m.py:9")
    # --mixed-precision params: the parameters' own dtypes (fqn -> dtype) where the program was traced with them
    # cast to the compute dtype (the rank holds them so: the master weights)
    master_dtypes: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)  # what makes a pipelined run differ from eager (printed as warnings)

    @property
    def batch_dim(self) -> int:
        """The dim of the batched inputs and the target that holds the samples (the model file's ``batch_dim``)."""
        return self.model_file.batch_dim


def batch_size_of(leaves: list, where: str, dim: int = 0) -> int:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            return leaf.shape[dim]
    raise ModelFileError(f"{where}: no tensor input with a batch dimension (dim {dim}) to split into microbatches")


def batched_leaves(leaves: list, batch_size: int, dim: int = 0) -> list:
    """Per leaf: a tensor whose ``dim`` holds the batch's samples (chunked into microbatches; the rest repeated)."""
    return [isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == batch_size for leaf in leaves]


def first_microbatch(leaves: list, batched: list, batch_size: int, num_microbatches: int, dim: int = 0) -> list:
    """Slice microbatch 0 (the size ``torch.tensor_split`` gives it) from every batched leaf, along ``dim``."""
    size = -(-batch_size // num_microbatches)
    return [leaf.narrow(dim, 0, size) if is_batched else leaf for leaf, is_batched in zip(leaves, batched)]


REAL_TRACE_LIMIT_BYTES = 1 << 30  # on_meta="auto": models up to this size are traced with real weights


def _state_tensors(model: torch.nn.Module) -> list:
    """The model's parameters and buffers, each tensor once (tied weights are one)."""
    return list({id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())


def _state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _state_tensors(model))


REAL_FIT = 0.8  # a retry with real weights only where they take at most this share of the free host memory


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def _count(model: torch.nn.Module) -> str:
    count = sum(t.numel() for t in _state_tensors(model))
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.1f}K"


def build_model(model_file: ModelFile, on_meta) -> tuple:
    """``(model, notes)``: ``model()`` without storage when ``on_meta`` and it builds there, else for real.

    ``on_meta="auto"`` (what ``tracepp split`` uses) builds on meta first and, when the weights are small
    (``REAL_TRACE_LIMIT_BYTES``), builds the model again for real: code that branches on the device type
    (Hugging Face Mixtral counts experts with ``histc`` on float32 on CPU, int32 elsewhere) is then traced as
    the CPU ranks run it. Larger models stay on meta: their trace follows the accelerator's branch."""
    def built_alike(drew: bool) -> None:  # model() builds the same weights from any generator state it draws from
        why = model_rng.differs(model_file.model, model_file.path) if drew else None
        if why:
            raise TraceError(why)

    if not on_meta:
        built, drew = model_rng.draws(model_file.model)
        built_alike(drew)
        return built, []
    try:
        def on_meta_device():
            with torch.device("meta"):
                return model_file.model()

        built, drew = model_rng.draws(on_meta_device)
        if on_meta == "auto" and _state_bytes(built) <= REAL_TRACE_LIMIT_BYTES:
            built_alike(drew)
            return model_file.model(), []
        return built, [model_rng.note(model_file.path)] if drew else []
    except (ModelFileError, TraceError):
        raise
    except Exception as error:  # e.g. an init that reads a value (.item(), a data-dependent branch)
        note = (f"model() cannot be built on the meta device ({type(error).__name__}: {str(error).splitlines()[0]}); "
                f"built with real weights for tracing instead (planning then needs the whole model in memory)")
        return model_file.model(), [note]


def _input_device(leaves: list) -> torch.device:
    return next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))


def _replace_meta_device(program: torch.export.ExportedProgram, device: torch.device) -> None:
    """Weights on meta leave ``device='meta'`` in ops that name a device (``.to``, ``arange``, dtype/device
    assertions); the program runs where the inputs are, so name their device, as a real trace would."""
    meta = torch.device("meta")

    def fix(value):
        if isinstance(value, torch.device) and value == meta:
            return device
        return value

    for node in program.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, fix)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
    program.graph_module.recompile()


def _is_on_meta(model: torch.nn.Module) -> bool:
    return any(tensor.is_meta for tensor in list(model.parameters()) + list(model.buffers()))


def _device_clash(error: BaseException) -> bool:
    """``error`` (or one it was raised from) is a fake tensor's "meta and cpu" device mismatch: the model made a
    tensor on the inputs' device (a mask from the token ids) and met the weights on meta."""
    while error is not None:
        if type(error).__name__ == "FakeTensorDeviceMismatchError" or (
                "two devices" in str(error) and "meta" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _export_inputs_on_meta(model, args, kwargs, dynamic_shapes, error, watch=None):
    """The export of a model on meta weights again with its inputs on meta too, where the first one failed on a
    device clash (CPM-Ant's attention mask, made from the token ids on the CPU, meets its scores on meta); None where
    that is not the failure or the second export fails as well (forward reads an input's values)."""
    if not _device_clash(error):
        return None
    on_meta = pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, (args, kwargs))
    try:
        return _export(model, on_meta[0], on_meta[1], dynamic_shapes, watch)
    except Exception:
        return None


def _export(model, args, kwargs, dynamic_shapes, watch: Optional[sequence_first.Watch] = None):
    """``torch.export.export``, its graph modules' Python code generated only when first run (export recompiles its
    graph several times on the way, and the split never runs the whole program: 13% of a 671B model's trace), and
    each node's stack trace taken from the frames fx keeps only (:class:`_KeptFrames`); ``nn.TransformerEncoder``'s
    causal-mask hint off (``sequence_first.causal_mask_hint_off``), sequence-first modules watched (``watch``)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # a torch without lazy graph modules: export as it is
        lazy = contextlib.nullcontext()
    else:
        lazy = _use_lazy_graph_module(True)
    watched = watch.on(model) if watch is not None else contextlib.nullcontext()
    with lazy, _kept_frames(), sequence_first.causal_mask_hint_off(), watched:
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)


class _KeptFrames:
    """What ``torch.fx``'s tracer records as each node's ``stack_trace``, with the work on the frames it then drops
    left out. fx takes ``CapturedTraceback.extract().summary()`` per node: every frame of the stack (about a hundred
    in a Hugging Face model under export) symbolized and its source line read, then keeps the frames from the
    outermost ``forward`` on that are not in torch's ``uninteresting_files()`` (``TracerBase._filter_traceback_frames``):
    22% of a 671B model's trace. This returns that outermost ``forward`` frame and the interesting frames after it,
    and fx's filter, run on them, keeps exactly what it kept before (``tests/test_trace_errors.py`` compares the
    two)."""

    __slots__ = ("frames",)

    def __init__(self, frames):
        self.frames = frames  # what fx keeps, outermost first (the outermost ``forward`` first), or None: nothing

    @staticmethod
    def extract(*, script=False, cpp=False, skip=0):
        """One walk up the stack: the interesting frames (not in ``uninteresting_files()``) and, at each
        ``forward``, how many of them lie inside it; the outermost ``forward`` met decides what is kept."""
        from torch.fx.experimental.symbolic_shapes import uninteresting_files  # lru-cached

        boring = uninteresting_files()
        frame = sys._getframe(1 + skip)
        interesting, outermost = [], None
        while frame is not None:
            code = frame.f_code
            if code.co_name == "forward":
                outermost = ((code.co_filename, frame.f_lineno, "forward"), len(interesting))
            if code.co_filename not in boring:
                interesting.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        if outermost is None:  # fx keeps no frame of a stack without a forward
            return _KeptFrames(None)
        forward, inside = outermost
        kept = interesting[:inside]
        kept.append(forward)
        kept.reverse()
        return _KeptFrames(kept)

    def summary(self):
        if self.frames is None:
            return traceback.StackSummary()
        return traceback.StackSummary.from_list([traceback.FrameSummary(*frame) for frame in self.frames])


@contextlib.contextmanager
def _kept_frames():
    """:class:`_KeptFrames` in place of ``torch.fx.proxy``'s ``CapturedTraceback`` while export traces, where that
    torch takes its stacks the way it describes (else fx's own capture)."""
    import torch.fx.proxy as fx_proxy

    tracer = getattr(fx_proxy, "TracerBase", None)
    if (getattr(fx_proxy, "CapturedTraceback", None) is None
            or getattr(tracer, "_record_forward_stack_traces_only", False)
            or not hasattr(tracer, "_filter_traceback_frames")
            or os.environ.get("TRACEPP_FX_STACKS") == "torch"):
        yield
        return
    original = fx_proxy.CapturedTraceback
    fx_proxy.CapturedTraceback = _KeptFrames
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = original


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Cast ``model``'s floating parameters to ``dtype`` in place (buffers stay: FSDP2's ``param_dtype`` casts
    parameters only); returns fqn -> the dtype each had (every alias of a tied weight)."""
    named = list(model.named_parameters(remove_duplicate=False))
    before = {fqn: param.dtype for fqn, param in named}  # every alias, before its tied twin is cast
    done = set()
    for _fqn, param in named:
        if param.is_floating_point() and param.dtype != dtype and id(param) not in done:
            done.add(id(param))
            param.data = param.data.to(dtype)
    return {fqn: dtype_ for fqn, dtype_ in before.items() if dtype_ != dtype and dtype_.is_floating_point}


def _mark_masters(program: torch.export.ExportedProgram, master_dtypes: dict) -> None:
    """Each parameter placeholder traced in the compute dtype records the dtype the rank holds it in."""
    targets = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
               if spec.kind == torch.export.graph_signature.InputKind.PARAMETER}
    for node in program.graph.nodes:
        if node.op == "placeholder" and targets.get(node.name) in master_dtypes:
            node.meta[MASTER_DTYPE] = master_dtypes[targets[node.name]]


def trace(model_file: ModelFile, num_microbatches: int, dynamic_shapes: Any = None, on_meta=False,
          param_dtype: Optional[torch.dtype] = None) -> Traced:
    """``param_dtype`` (``--mixed-precision params`` below fp32): the model is traced as it trains under FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)``: its floating parameters and floating inputs cast to it, buffers as they
    are, so every dtype the program records (a norm's ``.to(input_dtype)``, the boundaries) is the one training
    computes in."""
    model, notes = build_model(model_file, on_meta)
    built_bytes = _state_bytes(model)  # as model() builds it, before a cast to the compute dtype
    master_dtypes = cast_parameters(model, param_dtype) if param_dtype is not None else {}
    args, kwargs = model_file.example_inputs(), model_file.example_kwargs()
    leaves, spec = pytree.tree_flatten((args, kwargs))
    batch_dim = model_file.batch_dim
    batch_size = batch_size_of(leaves, f"{model_file.path}: example_inputs()", batch_dim)
    if num_microbatches < 1 or num_microbatches > batch_size:
        raise ValueError(
            f"--microbatches {num_microbatches} does not fit the example batch of {batch_size} samples: "
            f"choose 1..{batch_size}"
        )
    batched = batched_leaves(leaves, batch_size, batch_dim)
    mb_args, mb_kwargs = pytree.tree_unflatten(_cast_inputs(first_microbatch(leaves, batched, batch_size,
                                                                            num_microbatches, batch_dim),
                                                            param_dtype), spec)
    mb_args, mb_kwargs = tuple(mb_args), dict(mb_kwargs)
    if dynamic_shapes is None and model_file.dynamic_shapes is None and batch_size % num_microbatches:
        # unequal microbatches need a symbolic batch dim; declaring it is what the user would do anyway
        dynamic_shapes = DynamicFlags(batch=True)
        notes.append(f"{num_microbatches} microbatches do not divide the {batch_size}-sample batch: the batch "
                     f"dim is traced as dynamic ('batch') so microbatches may differ in size")
    leaf_of_arg = _leaf_index_of_args(model, mb_args, mb_kwargs)
    if isinstance(dynamic_shapes, DynamicFlags):
        batched_args = {name: batched[index] for name, index in leaf_of_arg.items()}
        export_shapes, arg_dim_names = export_dynamic_shapes(dynamic_shapes, model, mb_args, mb_kwargs, batched_args,
                                                             batch_dim)
    else:
        export_shapes = dynamic_shapes if dynamic_shapes is not None else model_file.dynamic_shapes
        arg_dim_names = names_from_model_spec(export_shapes, model, mb_args, mb_kwargs)
    dynamic_batch = any(dim == batch_dim and arg in leaf_of_arg and batched[leaf_of_arg[arg]]
                        for arg, dim in arg_dim_names)
    if dynamic_batch and -(-batch_size // num_microbatches) == 1 and batch_size >= 2:
        # export specialises a size-1 dim to the constant 1; the trace is symbolic in the batch anyway,
        # so trace two samples
        mb_args, mb_kwargs = pytree.tree_unflatten(_cast_inputs(first_microbatch(leaves, batched, batch_size,
                                                                                batch_size // 2, batch_dim),
                                                                param_dtype), spec)
        mb_args, mb_kwargs = tuple(mb_args), dict(mb_kwargs)
    mb_leaves = pytree.tree_leaves((mb_args, mb_kwargs))
    traced_size = next((leaf.shape[batch_dim] for leaf, flag in zip(mb_leaves, batched) if flag), None)
    watch = sequence_first.Watch(batch_dim, traced_size, batch_size)
    probe = batch_mixing.probe(model, num_microbatches, batch_size, sum(
        leaf.numel() for leaf, flag in zip(leaves, batched) if flag)) if param_dtype is None else None
    try:
        program = _export(model, mb_args, mb_kwargs, export_shapes, watch)
    except Exception as first_error:
        if not _is_on_meta(model):
            raise TraceError(_explain(first_error, model, model_file.path, param_dtype)) from first_error
        error = first_error
        program = _export_inputs_on_meta(model, mb_args, mb_kwargs, export_shapes, error, watch)
        if program is not None:
            notes.append(f"the model does not trace with meta weights and inputs on the CPU ({type(error).__name__}: "
                         f"a tensor made on the inputs' device met the weights); traced with its inputs on meta too")
    if program is None:
        # forward may read a parameter's or buffer's value; try once with real weights before giving up, where
        # they fit in this machine's memory (a model planned on meta because it does not would be killed)
        from tracepp.runtime import memory_fit

        needed, available = built_bytes, memory_fit.available_ram()
        if available is not None and needed > available * REAL_FIT:
            raise TraceError(
                _explain(error, model, model_file.path, param_dtype)
                + f"\n  the model does not trace with meta weights, and tracing it with real weights would need "
                  f"{_size(needed)} of its {_count(model)} parameters and buffers in host memory, where "
                  f"{_size(available)} are free: make forward() run on meta tensors (the error above: a "
                  f"tensor made on the CPU, a value read with .item()), or plan a smaller config") from error
        model = model_file.model()
        if param_dtype is not None:
            cast_parameters(model, param_dtype)
        try:
            program = _export(model, mb_args, mb_kwargs, export_shapes, watch)
        except Exception as real_error:
            raise TraceError(_explain(real_error, model, model_file.path, param_dtype)) from real_error
        notes.append(f"the model does not trace with meta weights ({type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else ''}); traced with real weights instead")
    watch.check()  # a sequence-first module reached by microbatches cut along its sequence: stop, say why
    checked = {}  # the autograd Functions compared with autograd's derivative of their forward
    if model_file.training and not _is_on_meta(model):
        program, checked, said = custom_functions.settle(
            model, program, mb_args, mb_kwargs, model_file.path,
            lambda: _export(model, mb_args, mb_kwargs, export_shapes,
                            sequence_first.Watch(batch_dim, traced_size, batch_size)))
        notes.extend([said] if said else [])
    inline_grad_mode_regions(program, model_file.path)
    if model_file.training:
        reached = grad_modes.needs_grad(program, model)  # the values a gradient reaches, walked once for the three
        cannot = grad_modes.untrainable(program, model, model_file.path, reached)
        if cannot:
            raise TraceError(cannot)
        unreached = grad_modes.unreached_note(program, model, reached)
        if unreached:
            notes.append(unreached)
        notes.extend(custom_functions.check_custom_functions(program, model, model_file.path, reached, checked))
    if master_dtypes:
        _mark_masters(program, master_dtypes)
    random_ops = random_draws(program)
    if random_ops:
        notes.append(random_note(random_ops, model_file.training))
    warnings = []
    mixing = None if random_ops else batch_mixing.check(probe, program, leaves, spec, batched, batch_size,
                                                         num_microbatches, batch_dim)
    if mixing:
        warnings.append(mixing + sequence_first.hint(model, batch_dim))
    if _is_on_meta(model):
        _replace_meta_device(program, _input_device(leaves))
    dim_names = {(leaf_of_arg[arg], dim): name for (arg, dim), name in arg_dim_names.items() if arg in leaf_of_arg}
    return Traced(program, model, model_file, num_microbatches, batch_size, batched, leaves, dim_names, notes,
                  random_ops, master_dtypes, warnings)


def _explain(error: BaseException, model, path: str, param_dtype) -> str:
    """:func:`explain_export_failure`, and under ``--mixed-precision params`` a dtype clash named as what it is: the
    model computes with its weights' dtype and an fp32 tensor it never casts, which autocast would have unified."""
    text = explain_export_failure(error, model, path)
    message = str(error)
    if param_dtype is not None and "dtype" in message.lower() and any(
            name in message for name in ("BFloat16", "Half", "bfloat16", "float16")):
        name = str(param_dtype).replace("torch.", "")
        text = text.split("\n  what to try:")[0]  # not the code's shape: the dtypes it mixes
        text += (f"\n  what to try (mixed precision): the model was traced as --mixed-precision params trains it, with its parameters "
                 f"and floating inputs in {name} (buffers and tensors it makes stay fp32), and an op there mixes the "
                 f"two: cast the fp32 tensor to the activations' dtype in the model (e.g. cos.to(q.dtype), as Hugging "
                 f"Face models do), or split with --mixed-precision autocast (fp32 parameters, autocast per op)")
    return text


def _cast_inputs(leaves: list, dtype: Optional[torch.dtype]) -> list:
    """The model's floating inputs in ``dtype``, as FSDP2's ``cast_forward_inputs`` casts a root module's (the runtime
    casts each batch so, ``RankExecutor.input_dtype``)."""
    if dtype is None:
        return leaves
    return [leaf.to(dtype) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf
            for leaf in leaves]


_OFF_WHEN = {"p": 0, "dropout_p": 0, "train": False}  # an argument that makes a random op draw nothing


def random_draws(program: torch.export.ExportedProgram) -> list:
    """Each op of the traced program that draws random numbers, as ``aten.exponential_ at
    modeling_phimoe.py:477``, in graph order: an op torch tags ``nondeterministic_seeded`` (rand_like,
    exponential_, bernoulli, dropout, attention with dropout), unless its arguments make it draw nothing (a
    probability of 0, ``train=False``). A grad-mode region's body not yet inlined is read too (its ops after the
    region's own: reformer-pytorch's reversible layers draw their rotations under ``torch.no_grad()``)."""
    from tracepp.split.rules import where

    found = []
    graphs = [m.graph for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    for node in (node for graph in graphs for node in graph.nodes):
        tags = getattr(node.target, "tags", ())
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
            continue
        arguments = node.target._schema.arguments
        given = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(arguments)}
        if any(name in given and given[name] == off for name, off in _OFF_WHEN.items()):
            continue
        line = where(node)
        found.append(f"{node.target.name().replace('::', '.')}" + (f" at {line}" if line else ""))
    return found


def random_note(random_ops: list, training: bool) -> str:
    """What a user reads when the model draws random numbers: which ops, and why a pipelined run equals eager in
    distribution and not number for number."""
    distinct = list(dict.fromkeys(random_ops))
    shown = ", ".join(distinct[:4]) + (f" and {len(distinct) - 4} more" if len(distinct) > 4 else "")
    return (f"the model draws random numbers{' in training' if training else ''} ({len(random_ops)} op(s): "
            f"{shown}): each rank draws them for its own stages, one microbatch at a time, so a pipelined run "
            f"equals eager in distribution, not number for number. To compare with eager training exactly, turn "
            f"them off (dropout 0, or the model's deterministic branch, e.g. its router in eval mode)")


def _leaf_index_of_args(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """forward() argument name -> index of its leaf in the flattened (args, kwargs), for tensor arguments."""
    import inspect

    try:
        positional = list(inspect.signature(model.forward).bind(*args, **kwargs).arguments)[:len(args)]
    except TypeError:
        return {}
    result, offset = {}, 0
    for name, value in zip(positional + list(kwargs), list(args) + list(kwargs.values())):
        if isinstance(value, torch.Tensor):
            result[name] = offset
        offset += len(pytree.tree_leaves(value))
    return result


def _hop_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "_name", "") if node.op == "call_function" else ""


def inline_grad_mode_regions(program: torch.export.ExportedProgram, model_path: str = "") -> None:
    """Copy the bodies of export's grad-mode and autocast regions into the top-level graph, in place.

    Export wraps code run under ``torch.no_grad()`` (e.g. Hugging Face's rotary embedding) in a
    ``wrap_with_set_grad_enabled`` higher-order op whose body is a submodule, and code run under ``torch.autocast``
    in ``wrap_with_autocast``; a region inside another is a higher-order op inside the outer body (OLMo-core's
    rotary embedding computes its table under ``autocast(enabled=False)`` inside another such region). A stage is
    one flat generated function with no submodules, so every body is inlined, the innermost first. Outputs of a
    grad-disabled region are detached, which is exactly what running it under no_grad gives. An autocast region
    that is disabled computes exactly the ops of its body: its nodes are marked ``AUTOCAST_OFF``, and the stage
    code generator turns autocast off around them, so under ``--precision bf16`` they still run in fp32 (HF's rotary
    tables). An enabled one whose body gives every value the dtype export recorded without autocast's casts (no op
    it lists meets a tensor of another dtype) is its body too. Any other enabled one is traced again under its
    autocast, so the casts autocast inserts become ops of the graph (``aten._to_copy``), marked ``AUTOCAST_OFF`` so
    that nothing casts them again. Any other higher-order op (torch.cond) is reported, since its body cannot be
    split.
    """
    graph_module = program.graph_module
    parameters = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
                  if spec.kind == torch.export.graph_signature.InputKind.PARAMETER}
    _inline_regions(graph_module, parameters, model_path)
    graph_module.graph.lint()
    graph_module.recompile()


_REGIONS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


def _inline_regions(graph_module: torch.fx.GraphModule, parameters: dict, model_path: str) -> None:
    """:func:`inline_grad_mode_regions` on one graph (the program's, or a region's body): each region's body made
    flat first (its own regions inlined into it), then copied in place of the region. ``parameters``: placeholder
    name -> the parameter's FQN, for the placeholders of ``graph_module`` that are parameters."""
    graph = graph_module.graph
    inlined = []
    for node in list(graph.nodes):
        name = _hop_name(node)
        if name not in _REGIONS:
            continue
        if name == "wrap_with_set_grad_enabled":
            grad_enabled, body_node, operands, autocast = node.args[0], node.args[1], node.args[2:], None
        else:
            grad_enabled, body_node, operands, autocast = True, node.args[4], node.args[5:], node.args[:4]
        body = getattr(graph_module, body_node.target)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        _inline_regions(body, {p.name: parameters[o.name] for p, o in zip(placeholders, operands)
                               if isinstance(o, torch.fx.Node) and o.name in parameters}, model_path)
        if not grad_enabled:
            custom_functions.check_custom_backward(body, operands, parameters, model_path)
        autocast_off = False
        if autocast is not None:
            device_type, dtype, enabled, cache_enabled = autocast
            autocast_off = not enabled
            if enabled and not _autocast_casts_nothing(body, operands, device_type):
                body = _with_autocast_casts(body, operands, node, graph_module, model_path)
                autocast_off = True
        _copy_body(graph, node, body, operands, grad_enabled, autocast_off, graph_module, model_path)
        if not body_node.users:
            graph.erase_node(body_node)
            inlined.append(body_node.target)
    for target in set(inlined):
        if not any(n.op == "get_attr" and n.target == target for n in graph.nodes):
            graph_module.delete_submodule(target)
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(graph_module, node.target, None), torch.fx.GraphModule):
            user = next(iter(node.users), node)
            raise TraceError(_nested_region_message(user, model_path, graph_module))


def _copy_body(graph: torch.fx.Graph, node: torch.fx.Node, body: torch.fx.GraphModule, operands, grad_enabled: bool,
               autocast_off: bool, graph_module: torch.fx.GraphModule, model_path: str) -> None:
    """Copy the (flat) ``body`` of the region ``node`` into ``graph`` before it, and use its results in its place."""
    env: dict = {}
    outer_stack = node.meta.get("nn_module_stack") or {}
    with graph.inserting_before(node):
        body_placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for placeholder, operand in zip(body_placeholders, operands):
            env[placeholder] = operand
        results = None
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = inner.args[0]
                break
            if inner.op == "get_attr":
                raise TraceError(_nested_region_message(next(iter(inner.users), node), model_path, body))
            copied = graph.node_copy(inner, lambda n: env[n])
            # keep the enclosing modules, so split points and stage balancing see the full module path
            copied.meta["nn_module_stack"] = {**outer_stack, **(inner.meta.get("nn_module_stack") or {})}
            if autocast_off:  # stage code runs it with autocast off, as eager does (--precision bf16)
                copied.meta[AUTOCAST_OFF] = True
            if not copied.meta.get("stack_trace"):
                copied.meta["stack_trace"] = node.meta.get("stack_trace")
            env[inner] = copied
        outputs = list(results) if isinstance(results, (tuple, list)) else [results]
        mapped = []
        for value in outputs:
            same = _input_returned(value) if isinstance(value, torch.fx.Node) else None
            if same is not None:  # eager returns the input itself (x.to(x.dtype)): its gradient flows on
                mapped.append(env[same])
                continue
            value = env.get(value, value) if isinstance(value, torch.fx.Node) else value
            if not grad_enabled and isinstance(value, torch.fx.Node):
                detached = graph.call_function(torch.ops.aten.detach.default, (value,))
                detached.meta = {key: value.meta[key] for key in ("val", "nn_module_stack", "stack_trace")
                                 if key in value.meta}
                value = detached
            mapped.append(value)
    if isinstance(results, (tuple, list)):
        for user in list(node.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                raise TraceError(_nested_region_message(node, model_path, graph_module))
            user.replace_all_uses_with(mapped[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(mapped[0])
    graph.erase_node(node)


def _dtypes(value) -> list:
    return [leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in pytree.tree_leaves(value)]


class _CastFound(Exception):
    pass


def _autocast_casts_nothing(body: torch.fx.GraphModule, operands, device_type: str) -> bool:
    """Whether every node of an enabled autocast region's ``body``, run on the traced (fake) values without
    autocast, gives the dtypes export recorded under it: then no op autocast lists met a tensor of another dtype
    (autocast's casts change the dtype of what the op returns), and the body alone computes the region."""
    from torch._guards import detect_fake_mode

    values = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in operands]
    if any(isinstance(o, torch.fx.Node) and value is None for o, value in zip(operands, values)):
        return False
    mode = detect_fake_mode(values)
    if mode is None:
        return False

    class Compare(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if n.op == "call_function" and "val" in n.meta and _dtypes(result) != _dtypes(n.meta["val"]):
                raise _CastFound(n.name)
            return result

    try:
        with mode, torch.autocast(device_type, enabled=False):
            Compare(body).run(*values)
    except _CastFound:
        return False
    except Exception:  # an op that needs autocast's casts to run at all (dtypes it mixes)
        return False
    return True


def _with_autocast_casts(body: torch.fx.GraphModule, operands, node: torch.fx.Node,
                         graph_module: torch.fx.GraphModule, model_path: str) -> torch.fx.GraphModule:
    """``body`` traced again (on the traced fake values) under the autocast of its region ``node``, below autocast,
    so that each cast autocast inserts is an op of the returned graph; each op keeps the stack trace and modules of
    the node it comes from. Refused where it cannot be traced so."""
    from torch._guards import detect_fake_mode
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    device_type, dtype, _enabled, cache_enabled = node.args[:4]
    values = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in operands]

    def run(*args):
        with torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=cache_enabled):
            return tuple(pytree.tree_leaves(torch.fx.Interpreter(body).run(*args)))

    try:
        with detect_fake_mode(values) or contextlib.nullcontext(), fx_traceback.preserve_node_meta():
            traced = make_fx(run, tracing_mode="real")(*values)
    except Exception as error:
        line = _region_line(node, graph_module)
        dtype_name = str(dtype).replace("torch.", "")
        raise TraceError(
            f"torch.autocast({device_type!r}, dtype={dtype_name}) at {line or 'a line of ' + (model_path or 'the model')}"
            f" computes ops in {dtype_name}, and tracepp could not make the casts autocast inserts there ops of the "
            f"graph ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}): cast explicitly in "
            f"the model instead (x.to(torch.{dtype_name}) before the matmuls, the result back after), or remove the "
            f"autocast region from forward() and train with --precision") from error
    traced.graph.eliminate_dead_code()
    return traced


def _region_line(node: torch.fx.Node, graph_module: torch.fx.GraphModule) -> str:
    """``file.py:42``: the model's line a region (or any higher-order op) runs, from its own stack trace, else from
    its body's or its results' (export records none on the region node itself)."""
    traces = [node.meta.get("stack_trace")]
    body = next((getattr(graph_module, a.target, None) for a in node.args
                 if isinstance(a, torch.fx.Node) and a.op == "get_attr"), None)
    if isinstance(body, torch.fx.GraphModule):
        traces += [n.meta.get("stack_trace") for n in body.graph.nodes]
    traces += [user.meta.get("stack_trace") for user in node.users]
    for trace in traces:
        lines = re.findall(r'File "([^"]+)", line (\d+)', trace or "")
        user = [(file, line) for file, line in lines if "site-packages/torch/" not in file
                and not file.startswith("<") and os.path.dirname(file) != os.path.dirname(__file__)]
        if user:
            return f"{os.path.basename(user[-1][0])}:{user[-1][1]}"
    return ""


def _input_returned(node: torch.fx.Node):
    """The region's placeholder that ``node`` is in eager, or None. ``x.to(x.dtype)`` and ``.contiguous()`` of a
    contiguous ``x`` return ``x`` itself, even under ``no_grad``: a region output made that way is the input, with
    its gradient (Dots3's indexer returns ``hidden_states.to(dtype)`` beside its indices, and the gate reads it)."""
    while node.op == "call_function":
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        source = node.args[0]
        out, into = node.meta.get("val"), source.meta.get("val")
        if not (isinstance(out, torch.Tensor) and isinstance(into, torch.Tensor)):
            return None
        if node.target in (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device):
            at = {torch.ops.aten.to.dtype: 3, torch.ops.aten.to.device: 4}.get(node.target)
            copy = node.kwargs.get("copy") or (at is not None and len(node.args) > at and node.args[at])
            if copy or out.dtype != into.dtype or out.device != into.device:
                return None
        elif node.target is torch.ops.aten.contiguous.default:
            if not into.is_contiguous():
                return None
        else:
            return None
        node = source
    return node if node.op == "placeholder" else None


def _nested_region_message(node: torch.fx.Node, model_path: str, graph_module=None) -> str:
    line = _region_line(node, graph_module) if graph_module is not None else ""
    where = f" at {line}" if line else ""
    op = _hop_name(node) or str(node.target)
    return (f"the traced graph of {model_path or 'the model'} holds a higher-order op '{op}'{where} whose body is "
            f"a nested graph; tracepp splits flat graphs only: replace torch.cond/control-flow ops with "
            f"torch.where")


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
        # "<string>"/"<eval_with_key>" frames are code torch generated while tracing, not the user's
        if (not filename.startswith(torch_dir) and "site-packages/torch" not in filename and filename != __file__
                and not filename.startswith("<")):
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
    # torch's wording when forward returns an object pytree cannot flatten (a class, not a tuple/dict/tensor)
    unknown = re.search(r"Found <class '([\w.]+)'> in output, which is not a known type", message)
    if unknown:
        where = " (in the output of forward())"
        first_line = f"its output holds a {unknown.group(1)}, which torch.export cannot flatten"
    if "cache" in lowered and (unknown or "dynamiccache" in lowered or "cache" in type(error).__name__.lower()
                               or "pytree" in lowered):
        advice = ("the model's output holds a cache object (e.g. transformers' DynamicCache), which torch.export "
                  "cannot return: pass use_cache=False, i.e. example_kwargs() returning {'use_cache': False} "
                  "and the same in the kwargs batch(step) returns")
    elif unknown:
        advice = ("return tensors in a tuple, list or dict, or register the class as a pytree node "
                  "(torch.utils._pytree.register_dataclass or register_pytree_node) before tracing")
    elif "data-dependent" in lowered or "data dependent" in lowered or "guardondatadependent" in lowered:
        # before a declared dim's check: export's "could not extract specialized integer from data-dependent
        # expression u0" is a size made from values (nonzero's), not a dynamic dim. Not torch.cond: it exports, but
        # its branches are nested graphs that tracepp cannot split
        advice = ("a Python value depends on a tensor's values (an `if` or `.item()` on a tensor, or `len()` / a "
                  "size of what `nonzero` or a boolean mask picks, as a loop over each expert's tokens takes it): "
                  "keep it a tensor: torch.where for a branch (compute both), a mask's `sum()` or `torch.bincount` "
                  "for a count, routed experts dispatched by sorting the tokens by expert (as transformers' MoE "
                  "layers do); or compute it from shapes or constants")
    elif "constraints violated" in lowered or "specialized" in lowered:
        detail = " ".join(line.strip(" -") for line in message.splitlines()[1:4] if line.strip())
        advice = (f"a declared dynamic dim does not hold for the model's code ({detail}); narrow the dim's "
                  f"range (e.g. min=2, or the max the model supports), or leave that dim static")
    elif "unsupported" in lowered or "not supported" in lowered:
        advice = "this Python construct cannot be traced: rewrite it with torch ops, or move it out of forward()"
    else:
        advice = "simplify the code there (no Python side effects or data-dependent control flow in forward())"
    return f"torch.export failed to trace the model{where}: {first_line}\n  what to try: {advice}"
