"""Whether training reaches the model's parameters, checked on the traced program before it is split.

A forward run under ``torch.inference_mode()`` (Meta's reference Llama: ``@torch.inference_mode()`` on
``Transformer.forward``) cannot be trained eagerly (its outputs are inference tensors), and torch.export drops the
mode without a trace in the program: split, it would train what the model file's own loop cannot. A forward run
whole under ``torch.no_grad()`` is kept by export (its region's outputs detached) and gives no parameter a gradient:
training would change nothing. With a ``loss_fn`` (a training pipeline) both are refused, naming the module, its
decorator and line, and the fix. A submodule under ``no_grad`` (a frozen encoder, a rotary table) is a model's own
choice and trains as eager does.
"""
from __future__ import annotations

import inspect
import os
from typing import Optional

import torch


def _trainable_placeholders(program: torch.export.ExportedProgram, model: torch.nn.Module) -> dict:
    """{placeholder name: FQN} of the program's trainable parameters."""
    trainable = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {spec.arg.name: spec.target for spec in program.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.PARAMETER and spec.target in trainable}


def needs_grad(program: torch.export.ExportedProgram, model: torch.nn.Module) -> set:
    """The nodes of the program whose value carries a gradient in training: floating or complex values computed
    from a trainable parameter (not through a detach)."""
    import operator

    targets = _trainable_placeholders(program, model)
    found = set()
    for node in program.graph.nodes:
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]  # chunk's and split's outputs: a list
        floating = any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)
        if node.op == "placeholder":
            if node.name in targets and floating:
                found.add(node)
        elif node.op == "call_function" and node.target is not torch.ops.aten.detach.default:
            if any(arg in found for arg in node.all_input_nodes) and (floating or node.target is operator.getitem):
                found.add(node)
    return found


def _turned_off(function) -> Optional[str]:
    """The decorator turning gradients off that a function runs under (``@torch.inference_mode()``,
    ``@torch.no_grad()``, ``@torch.set_grad_enabled(False)``: torch's ``context_decorator`` keeps the context manager
    in the wrapper's closure), or None."""
    if not hasattr(function, "__wrapped__"):
        return None
    for cell in getattr(function, "__closure__", None) or ():
        try:
            held = getattr(cell.cell_contents, "__self__", cell.cell_contents)
        except ValueError:  # an empty cell
            continue
        if isinstance(held, torch.inference_mode) and getattr(held, "mode", True):
            return "torch.inference_mode()"
        if isinstance(held, torch.no_grad):
            return "torch.no_grad()"
        if isinstance(held, torch.set_grad_enabled) and getattr(held, "mode", True) is False:
            return "torch.set_grad_enabled(False)"
    return None


def _where(function) -> str:
    inner = inspect.unwrap(function)
    try:
        return f"{os.path.basename(inspect.getsourcefile(inner))}:{inspect.getsourcelines(inner)[1]}"
    except (OSError, TypeError):
        return getattr(inner, "__qualname__", "forward")


def decorated_forwards(model: torch.nn.Module) -> list:
    """``(module path, class name, decorator, where)`` for each module whose ``forward`` runs under a decorator
    turning gradients off, outermost first, each function once."""
    out, seen = [], set()
    for path, module in model.named_modules():
        function = module.__dict__.get("forward") or type(module).forward
        function = getattr(function, "__func__", function)
        name = _turned_off(function)
        if name is not None and id(function) not in seen:
            seen.add(id(function))
            out.append((path, type(module).__name__, name, _where(function)))
    return out


def _first_cut(program: torch.export.ExportedProgram, reached: set):
    """The first place a gradient path stops: a detach (a region traced without gradients ends in one) of a value
    that carries a gradient, or None."""
    return next((node for node in program.graph.nodes if node.op == "call_function"
                 and node.target is torch.ops.aten.detach.default and node.args and node.args[0] in reached), None)


def untrainable(program: torch.export.ExportedProgram, model: torch.nn.Module, model_path: str,
                reached: set) -> Optional[str]:
    """Why the traced program cannot train as the model file trains (a forward under inference mode; no gradient
    reaching any parameter), or None. ``reached``: :func:`needs_grad`'s nodes."""
    where = model_path or "the model file"
    forwards = decorated_forwards(model)
    inference = [f for f in forwards if f[2] == "torch.inference_mode()"]
    if inference:
        path, cls, name, line = inference[0]
        return (f"{cls}.forward ({'the model' if not path else path}, {line}) runs under {name}: its outputs are "
                f"inference tensors, which eager training cannot differentiate (\"element 0 of tensors does not "
                f"require grad\"), and torch.export drops the mode, so split, the pipeline would train what the model "
                f"file's own loop cannot. In {where}, build the model with a forward that runs with gradients (remove "
                f"the decorator, or bind its undecorated function in model(): model.forward = types.MethodType("
                f"{cls}.forward.__wrapped__, model)), or drop loss_fn for a forward-only pipeline")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return None
    if any(arg in reached for arg in program.graph.output_node().all_input_nodes):
        return None
    from tracepp.split.rules import where as line_of

    cut = _first_cut(program, reached)
    cause = next((f"{cls}.forward ({'the model' if not path else path}, {line}) runs under {name}"
                  for path, cls, name, line in forwards), None)
    if cause is None and cut is not None and line_of(cut):
        from tracepp.split.rules import op_name

        cause = (f"every path from them to the output passes a region the trace runs without gradients, at "
                 f"{cut.name} ({op_name(cut)}) at {line_of(cut)}: torch.no_grad(), .detach(), "
                 f"torch.utils.checkpoint with use_reentrant=True, or a torch.autograd.Function whose forward runs "
                 f"under no_grad (ring-attention's blockwise attention), which torch.export traces with gradients "
                 f"off, its own backward dropped (pass use_reentrant=False where it is called, or turn the library's "
                 f"checkpointing or custom attention off)")
    cause = cause or "no output of forward() is computed from a trainable parameter"
    return (f"no gradient of the loss reaches any of the model's {len(trainable)} trainable parameters: {cause}; "
            f"split, training would change nothing. In {where}, run forward() with gradients reaching the "
            f"parameters, or drop loss_fn for a forward-only pipeline")


def unreached_note(program: torch.export.ExportedProgram, model: torch.nn.Module, reached: set) -> Optional[str]:
    """A note naming the trainable parameters the traced program reads but gives no gradient (every path from them to
    the output through a region without gradients: a frozen teacher under no_grad, as meant; or a checkpoint torch
    .export traced with gradients off, use_reentrant=True, which eager would train), or None. ``reached``:
    :func:`needs_grad`'s nodes."""
    from tracepp.split.rules import where as line_of

    outputs = set(program.graph.output_node().all_input_nodes)
    targets = _trainable_placeholders(program, model)
    arrives: set = set()  # the nodes from which a gradient path reaches an output
    for node in reversed(list(program.graph.nodes)):
        if node in outputs or any(user in arrives for user in node.users if user.op != "output"
                                  and user.target is not torch.ops.aten.detach.default):
            if node in reached:
                arrives.add(node)
    cut = [node for node in program.graph.nodes if node.op == "placeholder" and node.name in targets
           and node.users and node not in arrives]
    if not cut:
        return None
    stop = _first_cut(program, reached)
    names = ", ".join(targets[node.name] for node in cut[:3]) + (f" and {len(cut) - 3} more" if len(cut) > 3 else "")
    return (f"{len(cut)} trainable parameter(s) take no gradient in the traced program ({names}): every path from "
            f"them to the output passes a region without gradients" + (f" (at {line_of(stop)})" if stop is not None
                                                                       and line_of(stop) else "")
            + "; where eager trains them (torch.utils.checkpoint with use_reentrant=True, which torch.export traces "
              "with gradients off), pass use_reentrant=False")
