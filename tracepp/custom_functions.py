"""``torch.autograd.Function``s with a backward of their own, in a traced model.

torch.export keeps a Function's forward only: split, the gradient through it is autograd's derivative of that
forward. That equals the Function's own backward where the backward is that derivative (BLOOM's hand-written GeLU
backward, reversible layers that recompute their inputs) and not otherwise (a straight-through estimator). So in
training, each model whose trace runs through such Functions is run eagerly twice on the example microbatch, with
their own backwards and with their forwards recorded by autograd (:func:`recorded`), and the gradients compared
(:func:`compare`): where they differ, the split is refused with the Function, the gradient and the difference; where
they agree, a Function whose forward runs its layers without gradients (Reformer's reversible layers, which
recompute them in the backward) is traced again with its forward recorded, so its parameters train. Where autograd
cannot differentiate a forward at all (mambapy's parallel scan, in place on views), the split is refused by name
(:func:`check_custom_functions`).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
import re
import sys
import threading
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils._pytree as pytree

_TORCH_DIR = os.path.dirname(torch.__file__)
_state = threading.local()  # .depth: how many recorded Functions' forwards are running


def _error(message: str):
    from tracepp.trace import TraceError  # trace imports this module

    return TraceError(message)


def _called(function, caller) -> str:
    """``"_ReversibleFunction.apply at reversible.py:162"``: a Function and the frame calling it (or None)."""
    return f"{function.__name__}.apply" + (f" at {os.path.basename(caller[0])}:{caller[1]}" if caller else "")


def _custom_function(frame):
    """The ``torch.autograd.Function`` subclass with a backward of its own that a stack frame's line calls
    (``hidden_states = _ReversibleFunction.apply(``), looked up in the module of the frame's file, or None."""
    file, _line, _function, code = frame
    match = re.search(r"(\w+)\.apply\(", code)
    if not match:
        return None
    module = _module_of(file)
    found = getattr(module, match.group(1), None)
    if not (isinstance(found, type) and issubclass(found, torch.autograd.Function) and "backward" in vars(found)):
        return None
    applied = getattr(found.apply, "__func__", None)  # not the model file's ordinary forward in its place
    return found if applied is torch.autograd.Function.apply.__func__ else None


def _call_site(callers: tuple):
    """The frame that calls a Function: the last of ``callers`` in the model's or a library's code, not torch's own
    (fairscale's checkpoint is called from ``nn.Sequential``'s loop, torch's from HF's decoder layer)."""
    outside = [frame for frame in callers if not frame[0].startswith(_TORCH_DIR)]
    return (outside or list(callers) or [None])[-1]


def check_custom_backward(body, operands, parameters: dict, model_path: str) -> None:
    """A grad-disabled region that uses parameters and runs inside an ``autograd.Function`` with a backward of its
    own (Reformer's reversible layers: the forward without gradients, the backward recomputing them): export keeps
    the forward only, so the traced model would never train those parameters. Refused with the function's name,
    its line and the model-file fix."""
    from tracepp.split.naming import frames

    used = sorted({parameters[o.name] for o in operands if isinstance(o, torch.fx.Node) and o.name in parameters})
    if not used:
        return
    for inner in body.graph.nodes:
        for frame in frames(inner.meta.get("stack_trace")):
            function = _custom_function(frame)
            if function is None:
                continue
            where = f"{os.path.basename(frame[0])}:{frame[1]}"
            raise _error(
                f"{function.__name__}.apply at {where} is a torch.autograd.Function with a backward of its own, and "
                f"the {len(used)} parameters it uses ({', '.join(used[:3])}{', ...' if len(used) > 3 else ''}) are "
                f"read with gradients off inside it: its backward computes their gradients (e.g. by recomputing the "
                f"layers, as reversible layers do). torch.export keeps the forward only, so split they would never "
                f"train. In {model_path or 'the model file'}, give it a forward that autograd records: call the "
                f"function's forward as ordinary code (`{function.__name__}.apply = staticmethod(...)`) and run the "
                f"layers inside it with gradients on (without their torch.no_grad())")


def _module_of(file: str):
    """The loaded module whose file is ``file``, or None. Each module's own ``__file__`` is read from its dict: a
    lazy placeholder in ``sys.modules`` (SpeechBrain registers one for each deprecated import path and optional
    integration) imports its target on any attribute read, and one whose target is not installed raises."""
    for module in list(sys.modules.values()):
        try:
            if vars(module).get("__file__") == file:
                return module
        except TypeError:  # an entry without a __dict__
            continue
    return None


def _function_forwards(file: str) -> list:
    """``(class, first line, last line)`` of the ``forward`` of each ``torch.autograd.Function`` subclass with a
    backward of its own in the module loaded from ``file``. A class whose ``apply`` was replaced (the model file's
    fix for such functions: its forward run as ordinary code) is not one."""
    module = _module_of(file)
    found = []
    for value in list(vars(module).values()) if module is not None else ():
        if not (isinstance(value, type) and issubclass(value, torch.autograd.Function)
                and "backward" in vars(value) and "forward" in vars(value)):
            continue
        if getattr(value.apply, "__func__", None) is not torch.autograd.Function.apply.__func__:
            continue
        forward = inspect.unwrap(getattr(vars(value)["forward"], "__func__", vars(value)["forward"]))
        code = getattr(forward, "__code__", None)  # under its decorators (ring-attention's @torch.no_grad())
        lines = [number for _start, _end, number in code.co_lines() if number is not None] if code else []
        if code is not None and code.co_filename == file and lines:
            found.append((value, code.co_firstlineno, max(lines)))
    return found


def _custom_function_regions(graph: torch.fx.Graph) -> list:
    """Each run of nodes export traced inside the ``forward`` of one call of a ``torch.autograd.Function`` with a
    backward of its own: ``(function class, caller frame or None, nodes)``, in graph order."""
    from tracepp.split.naming import frames

    def inside(stack_trace):  # (function, the frames calling its forward) or None; once per distinct stack
        trace = frames(stack_trace)
        for index, frame in enumerate(trace):
            if frame[2] != "forward":
                continue
            if frame[0] not in forwards:
                forwards[frame[0]] = _function_forwards(frame[0])
            function = next((cls for cls, first, last in forwards[frame[0]] if first <= frame[1] <= last), None)
            if function is not None:
                return function, tuple(trace[:index])
        return None

    regions, current, forwards, seen = [], None, {}, {}
    for node in graph.nodes:
        found = None
        if node.op == "call_function":
            stack_trace = node.meta.get("stack_trace") or ""
            if stack_trace not in seen:
                seen[stack_trace] = inside(stack_trace)
            if seen[stack_trace] is not None:
                function, callers = seen[stack_trace]
                key = (function, callers, tuple(node.meta.get("nn_module_stack") or ()))
                found = (key, function, _call_site(callers))
        if found is None:
            current = None
            continue
        if current is None or current[0] != found[0]:
            current = [found[0], found[1], found[2], []]
            regions.append(current)
        current[3].append(node)
    return [(function, caller, nodes) for _key, function, caller, nodes in regions]


def check_custom_functions(program: torch.export.ExportedProgram, model: torch.nn.Module, model_path: str,
                           reached: set, checked=()) -> list:
    """``torch.autograd.Function``s with a backward of their own: torch.export keeps the forward only, so split,
    the gradient through one is autograd's derivative of its forward. Each call is run forward and backward on the
    traced (fake) values: where autograd cannot differentiate the forward (mambapy's parallel scan updates in place
    views of tensors it read before, as its backward allows and autograd does not), the split is refused with the
    function, its in-place op and line, and the fix; else a note says whose backward is not kept. Functions in
    ``checked`` were compared with autograd eagerly (:func:`compare`, which has its own note): their traced ops
    are still differentiated here (the eager forward can differentiate where its traced ops cannot)."""
    regions = _custom_function_regions(program.graph)
    if not regions:
        return []
    from torch._guards import detect_fake_mode
    from tracepp.split.rules import where

    needs_grad = reached if model.training else set()  # grad_modes.needs_grad's nodes
    kept = []
    for function, caller, nodes in regions:
        called = _called(function, caller)
        if called not in kept and function not in checked:
            kept.append(called)
        if not any(node in needs_grad for node in nodes):
            continue
        error = _differentiate(nodes, needs_grad, detect_fake_mode)
        if error is None:
            continue
        in_place = [n for n in nodes if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
        ops = (f": its in-place ops ({in_place[0].target.name().replace('::', '.')} at {where(in_place[0])}"
               + (f" and {len(in_place) - 1} more" if len(in_place) > 1 else "") + ") update tensors its gradient "
               "needs") if in_place else ""
        raise _error(
            f"{called} is a torch.autograd.Function ({function.__module__}.{function.__qualname__}) with a backward "
            f"of its own; torch.export keeps its forward only, and autograd cannot differentiate that forward{ops} "
            f"({error}). Split, the model would not train. In {model_path or 'the model file'}, take the model's "
            f"path without the function (a library's reference implementation, e.g. mambapy's "
            f"MambaConfig(pscan=False)), or give the function a forward autograd can differentiate (no tensor updated "
            f"in place after it is read: each step's result in a new tensor)")
    if not kept:
        return []
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return [f"{shown}: torch.autograd.Function(s) with a backward of their own; torch.export keeps their forward "
            f"only, so split, the gradient through them is autograd's derivative of that forward, not their own "
            f"backward (equal where the backward is that derivative)"]


def _differentiate(nodes: list, needs_grad: set, detect_fake_mode):
    """Run ``nodes`` (one call's forward) on fake inputs, those that carry a gradient in training requiring it, and
    backward from every output that carries one: the first line of autograd's error, or None when it differentiates
    (or when the nodes cannot be run apart: nothing to say then)."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    values = [a.meta.get("val") for a in inputs]
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if mode is None or any(not isinstance(v, (torch.Tensor, torch.SymInt, int, float, bool)) for v in values):
        return None
    try:
        with mode, torch.enable_grad():
            env, leaves = {}, []
            for node, value in zip(inputs, values):
                if isinstance(value, torch.Tensor):
                    value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                    if node in needs_grad:
                        value.requires_grad_(True)
                        leaves.append(value)
                env[node] = value
            for node in nodes:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                env[node] = node.target(*args, **kwargs)
            outputs = [env[n] for n in nodes if any(u not in inside for u in n.users)]
            outputs = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
            if not (outputs and leaves):
                return None
    except Exception:
        return None
    try:
        with mode:
            torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)
    except RuntimeError as error:
        return str(error).splitlines()[0].split(". Hint:")[0][:300]
    return None



def used(program: torch.export.ExportedProgram) -> dict:
    """The ``torch.autograd.Function`` classes with a backward of their own whose forward the trace ran, in the
    program's graph or in a grad-mode region's body, in order of first use: each with where it is first called
    (``"_ReversibleFunction.apply at reversible.py:162"``)."""
    found = {}
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for function, caller, _nodes in _custom_function_regions(module.graph):
                found.setdefault(function, _called(function, caller))
    return found


def runs_without_grad(program: torch.export.ExportedProgram) -> bool:
    """Whether a grad-disabled region of the trace runs inside such a Function's forward (reversible layers)."""
    for module in program.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if (node.op == "call_function" and getattr(node.target, "_name", "") == "wrap_with_set_grad_enabled"
                    and node.args[0] is False and _custom_function_regions(getattr(module, node.args[1].target).graph)):
                return True
    return False


class _Context:
    """What a Function's forward may do with its ``ctx`` when it runs as ordinary code: keep anything, save tensors
    for a backward that will not run."""

    def __init__(self, count: int):
        self.needs_input_grad = (True,) * count
        self.saved_tensors = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value


def _model_code(frame, files: set) -> bool:
    """Whether ``frame`` (the caller of ``no_grad.__enter__``) is the model's code or a recorded Function's: a file
    outside torch or one of ``files`` (the Functions' own: torch's reentrant checkpoint), or torch's decorator wrapper
    around such a function (``@torch.no_grad()``). torch's other code keeps its no_grad."""
    if frame is None:
        return False
    if frame.f_code.co_name == "decorate_context":
        frame = frame.f_locals.get("func")
    code = getattr(frame, "f_code", None) or getattr(frame, "__code__", None)
    return code is not None and (not code.co_filename.startswith(_TORCH_DIR) or code.co_filename in files)


@contextlib.contextmanager
def _applies_replaced(functions, make):
    """Each of ``functions`` called through ``make(function, own_apply)`` for the time of the block: the class's
    ``apply``, and every module-level name bound to it (ring-attention's ``ring_flash_attn =
    RingFlashAttentionFunction.apply``, which replacing the class's ``apply`` does not reach)."""
    own = {function: vars(function).get("apply") for function in functions}
    originals = {function: function.apply for function in functions}
    bound = _bound_applies(functions)
    for function in functions:
        function.apply = staticmethod(make(function, originals[function]))
    for module, name, function, _value in bound:
        setattr(module, name, vars(function)["apply"].__func__)
    try:
        yield
    finally:
        for module, name, _function, value in bound:
            setattr(module, name, value)
        for function, apply in own.items():
            if apply is None:
                del function.apply
            else:
                function.apply = apply


@contextlib.contextmanager
def recorded(functions, straight=()):
    """``functions`` run as ordinary code: ``apply`` calls the forward (with a context that keeps what it is
    given), and the outermost ``torch.no_grad()`` the model's code enters inside such a forward keeps gradients on,
    so autograd (and torch.export) records the layers it runs. One inside that stays what it is: the backward of a
    reversible layer recomputes the layer under it too (HF Reformer's bucket sort). A function of ``straight`` (a
    straight-through estimator, :func:`straight_through`) runs as ``x + (f(x) - x).detach()``: its forward's value,
    its input's gradient passed through. Everything is restored on exit; :func:`compare` checks that the gradient
    so recorded is the Function's own."""
    def make(function, _own):
        def apply(*args, **kwargs):
            _state.depth = getattr(_state, "depth", 0) + 1
            _state.calls = getattr(_state, "calls", 0) + 1
            try:
                if "setup_context" in vars(function):  # forward(*args) with a setup_context of its own
                    out = function.forward(*args, **kwargs)
                else:
                    out = function.forward(_Context(len(args)), *args, **kwargs)
            finally:
                _state.depth -= 1
            if function in straight:
                x = next(a for a in args if isinstance(a, torch.Tensor))
                return x + (out - x).detach()
            return out
        return apply

    no_grad = torch.autograd.grad_mode.no_grad
    enter, leave = no_grad.__enter__, no_grad.__exit__
    files = {inspect.getsourcefile(function) or "" for function in functions}

    def keep_enter(self):
        self._tracepp_kept = (getattr(_state, "depth", 0) > 0 and not getattr(_state, "kept", 0)
                              and _model_code(sys._getframe(1), files))
        if self._tracepp_kept:
            _state.kept = 1
            return None
        return enter(self)

    def keep_exit(self, *exc):
        if getattr(self, "_tracepp_kept", False):
            _state.kept = 0
            return None
        return leave(self, *exc)

    with _applies_replaced(functions, make):
        no_grad.__enter__, no_grad.__exit__ = keep_enter, keep_exit
        try:
            yield
        finally:
            no_grad.__enter__, no_grad.__exit__ = enter, leave


def _straight_through(model: torch.nn.Module, functions, args: tuple, kwargs: dict) -> frozenset:
    """The ``functions`` each of whose calls in one eager forward of ``model`` (:func:`compare`'s copy) takes one
    floating tensor and gives one of its shape whose gradient, by the function's own backward, is its input's
    unchanged: straight-through estimators (HF BitNet's ``WeightQuant`` and ``ActQuant``)."""
    seen: dict = {}

    def make(function, own):
        def apply(*args_, **kwargs_):
            tensors = [a for a in args_ if isinstance(a, torch.Tensor)]
            passes = False
            if len(tensors) == 1 and tensors[0].is_floating_point():
                x = tensors[0]
                leaf = x.detach().requires_grad_(True)
                with torch.enable_grad():
                    y = own(*[leaf if a is x else a for a in args_], **kwargs_)
                if isinstance(y, torch.Tensor) and y.shape == x.shape and y.requires_grad:
                    probe = torch.randn_like(y)
                    (grad,) = torch.autograd.grad(y, leaf, probe, allow_unused=True)
                    passes = grad is not None and torch.equal(grad.to(probe.dtype), probe)
            seen.setdefault(function, []).append(passes)
            return own(*args_, **kwargs_)
        return apply

    try:
        with torch.random.fork_rng(devices=[]), _applies_replaced(functions, make), torch.enable_grad():
            torch.manual_seed(20261203)
            model(*args, **kwargs)
    except Exception:  # a model this cannot run: no function taken for one
        return frozenset()
    return frozenset(function for function, calls in seen.items() if calls and all(calls))


def _bound_applies(functions) -> list:
    """``(module, name, function, value)`` for each module-level name bound to one of ``functions``' ``apply`` (a
    module that wrote ``fn = SomeFunction.apply`` calls it by that name, which replacing the class's ``apply`` does
    not reach)."""
    base = torch.autograd.Function.apply.__func__
    found = []
    for module in list(sys.modules.values()):
        try:
            names = vars(module)
        except TypeError:
            continue
        for name, value in list(names.items()):
            if type(value) is not types.MethodType:  # no attribute read of anything else (absl's FLAGS parses argv)
                continue
            if value.__func__ is base and isinstance(value.__self__, type) and value.__self__ in functions:
                found.append((module, name, value.__self__, value))
    return found


@dataclass
class Comparison:
    """The gradients of one eager step with the Functions' own backwards against autograd's derivative of their
    forwards: the largest difference relative to the largest gradient, where it is, and the dtype compared in;
    ``dropped``: what the own backwards give a gradient and the recorded forwards none (a forward that cuts the
    graph itself: memcnn's ``detach_()`` of its outputs); ``straight``: the functions recorded as
    ``x + (f(x) - x).detach()`` (:func:`_straight_through`)."""
    relative: float
    where: str
    dtype: torch.dtype
    tolerance: float
    dropped: tuple = ()
    straight: frozenset = frozenset()

    @property
    def agrees(self) -> bool:
        return self.relative <= self.tolerance


_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}


def _seeded_seed():
    """``torch.seed()`` made repeatable for a comparison (HF Reformer reseeds from it every forward): each call
    seeds the next value of a fixed sequence, the same in both runs."""
    counter = iter(range(10_000_019, 1 << 62, 7919))

    def seed():
        value = next(counter)
        torch.manual_seed(value)
        return value
    return seed


def _cast(args, kwargs, dtype) -> tuple:
    """``(leaves, args, kwargs)``: every floating input a fresh leaf in ``dtype`` taking a gradient."""
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().to(dtype).requires_grad_(True)
        return value

    leaves, spec = pytree.tree_flatten((args, kwargs))
    leaves = [cast(leaf) for leaf in leaves]
    return (leaves, *pytree.tree_unflatten(leaves, spec))


def _gradients(model, functions, args, kwargs, dtype, own: bool, straight=()) -> dict:
    """name -> gradient after one backward of a fixed random projection of ``model``'s outputs, every floating
    input and parameter taking one, with the Functions' own backwards (``own``) or autograd's."""
    for parameter in model.parameters():
        parameter.grad = None
    leaves, run_args, run_kwargs = _cast(args, kwargs, dtype)
    seed = torch.seed
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(20261203)
        torch.seed = _seeded_seed()
        try:
            with contextlib.nullcontext() if own else recorded(functions, straight):
                output = model(*run_args, **run_kwargs)
        finally:
            torch.seed = seed
        outputs = [o for o in pytree.tree_leaves(output)
                   if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
        if not outputs:
            return {}
        generator = torch.Generator().manual_seed(7)
        sum((o * torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device)).sum()
            for o in outputs).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    grads.update({f"the model's input {index}": leaf.grad for index, leaf in enumerate(leaves)
                  if isinstance(leaf, torch.Tensor) and leaf.grad is not None})
    for parameter in model.parameters():
        parameter.grad = None
    return grads


def compare(model: torch.nn.Module, functions, args: tuple, kwargs: dict) -> Optional[Comparison]:
    """One eager step of a copy of ``model`` on the example microbatch with the Functions' own backwards against
    one with their forwards recorded by autograd (float64 where the model runs in it, else as it is); where they
    differ, once more with the straight-through estimators among them recorded as such (:func:`_straight_through`),
    kept where that agrees. None where autograd cannot differentiate a recorded forward (the caller refuses that by
    name) or the model has no gradient to compare."""
    for dtype in (torch.float64, None):
        try:
            copied = copy.deepcopy(model)
            if dtype is not None:
                copied = copied.to(dtype)
            compute = dtype or next((p.dtype for p in copied.parameters() if p.is_floating_point()), torch.float32)
            own = _gradients(copied, functions, args, kwargs, compute, own=True)
        except Exception:  # a model that does not run in float64 (a constant of float32's range): as it is
            if dtype is None:
                return None
            continue
        break
    if not own:
        return None

    def recorded_against_own(straight):
        calls = getattr(_state, "calls", 0)
        try:
            theirs = _gradients(copied, functions, args, kwargs, compute, own=False, straight=straight)
        except RuntimeError:
            return None
        if getattr(_state, "calls", 0) == calls:  # called by a name recorded() does not reach: nothing compared
            return None
        return _compared(own, theirs, compute, straight)

    found = recorded_against_own(frozenset())
    if found is None or found.dropped or found.agrees:
        return found
    _leaves, cast_args, cast_kwargs = _cast(args, kwargs, compute)
    straight = _straight_through(copied, functions, cast_args, cast_kwargs)
    again = recorded_against_own(straight) if straight else None
    return again if again is not None and again.agrees else found


def _compared(own: dict, theirs: dict, dtype, straight) -> Comparison:
    """The two runs' gradients side by side (a gradient one run has and the other not counts as zeros there, but
    one only the own backward gives, non-zero, is dropped)."""
    dropped = tuple(name for name in own if name not in theirs and bool(own[name].any()))
    tolerance = _TOLERANCE.get(dtype, 1e-2)
    if dropped:
        return Comparison(float("inf"), dropped[0], dtype, tolerance, dropped, straight)
    both = {name: (own.get(name), theirs.get(name)) for name in {**own, **theirs}}  # none: a zero gradient
    gaps = {name: float(((a if a is not None else 0) - (b if b is not None else 0)).abs().max())
            for name, (a, b) in both.items()}
    scale = max(float(g.abs().max()) for g in own.values()) or 1.0
    worst = max(gaps, key=gaps.get)
    return Comparison(gaps[worst] / scale, worst, dtype, tolerance, (), straight)


def named(functions: dict) -> str:
    shown = list(functions.values())[:3]
    return ", ".join(shown) + (f" and {len(functions) - 3} more" if len(functions) > 3 else "")


def refusal(functions: dict, found: Comparison, model_path: str) -> str:
    """The split's message where a Function's own backward is not autograd's derivative of its forward."""
    return (f"{named(functions)}: torch.autograd.Function(s) with a backward of their own that is not autograd's "
            f"derivative of their forward: one eager step on the example microbatch ({found.dtype}) gives gradients "
            f"{found.relative:.2e} apart (relative to the largest gradient; at {found.where}) with their own "
            f"backward and with autograd's. torch.export keeps the forward only, so split, the model would train "
            f"with the other gradient. In {model_path or 'the model file'}, write the gradient the forward should "
            f"have as ordinary code autograd records: a straight-through estimator as `x + (f(x) - x).detach()`, a "
            f"gradient scaled as `y.detach() + s * (y - y.detach())`")


def cut_refusal(functions: dict, found: Comparison, model_path: str) -> str:
    """The split's message where the Functions' forwards, recorded, give no gradient to what their backwards train."""
    shown = ", ".join(found.dropped[:3]) + (f" and {len(found.dropped) - 3} more" if len(found.dropped) > 3 else "")
    return (f"{named(functions)}: torch.autograd.Function(s) with a backward of their own, whose forward cuts the "
            f"graph itself (a detach, an in-place detach_(), its inputs' storage freed): their own backward gives "
            f"{len(found.dropped)} tensor(s) a gradient ({shown}) that autograd's derivative of the forward, even "
            f"recorded with gradients on, does not reach. torch.export keeps the forward only, so split they would "
            f"not train. In {model_path or 'the model file'}, build the model without the function: the library's "
            f"switch that runs the layers as ordinary code (memcnn's InvertibleModuleWrapper(..., disable=True), "
            f"reformer-pytorch's reverse_thres past the sequence length)")


def agreed(functions: dict, found: Comparison, retraced: bool) -> str:
    """The split's note where every Function's own backward agrees with autograd's derivative of its forward (or,
    for a straight-through estimator, of ``x + (f(x) - x).detach()``)."""
    through = [called for function, called in functions.items() if function in found.straight]
    return (f"{named(functions)}: torch.autograd.Function(s) with a backward of their own; split, the gradient "
            f"through them is autograd's derivative of their forward"
            + (f" ({', '.join(through)}: straight-through estimators, their backward passing the gradient through "
               f"unchanged, traced as x + (f(x) - x).detach())" if through else "")
            + f", which equals their own backward on the example microbatch ({found.relative:.1e} relative, "
            f"{found.dtype})"
            + ("; their forward runs layers without gradients (reversible layers, a reentrant checkpoint: "
               "recomputed in their own backward), so it was traced again with those layers recorded: their "
               "activations are kept as any layer's (--checkpoint recomputes them instead)" if retraced else ""))


def settle(model: torch.nn.Module, program: torch.export.ExportedProgram, args: tuple, kwargs: dict,
           model_path: str, export) -> tuple:
    """``(program, functions checked, note or None)`` for a traced training model on real weights: its Functions
    with a backward of their own compared (:func:`compare`); refused where the backward is neither the forward's
    derivative nor a straight-through estimator's, or the forward cuts the graph; traced again by ``export()``
    under :func:`recorded` where a forward runs layers without gradients (reversible layers, a reentrant
    checkpoint) or a straight-through estimator is to be recorded as one."""
    functions = used(program)
    found = compare(model, functions, args, kwargs) if functions else None
    if found is None:
        return program, {}, None
    if found.dropped:
        raise _error(cut_refusal(functions, found, model_path))
    if not found.agrees:
        raise _error(refusal(functions, found, model_path))
    retrace = runs_without_grad(program)
    if retrace or found.straight:
        with recorded(functions, found.straight):
            program = export()
    return program, functions, agreed(functions, found, retrace)
