"""The model file's ``loss_fn(output, target)`` traced with ``torch.export``, for context parallelism.

With ``--cp`` the last stage's output holds this rank's positions only, so the loss cannot run as written: a
mean over tokens must become a sum and a count summed over the cp ranks. The loss is traced once at split time,
on one microbatch's output (shapes from the traced model, on the meta device: no values) and the model file's
example target; ``split/context_parallel.py`` walks and rewrites it like a stage graph, and the last rank's
script carries it as one more function (``STAGE_FUNCTIONS["loss"]``). Dynamic dims of the output (a dynamic
sequence) are dynamic here too.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from tracepp.split.context_parallel import ContextParallelError, LossGraph


class _Loss(torch.nn.Module):
    def __init__(self, loss_fn, out_spec, output_leaves: list, target_spec, count: int):
        super().__init__()
        self.loss_fn, self.out_spec, self.output_leaves = loss_fn, out_spec, output_leaves
        self.target_spec, self.count = target_spec, count

    def forward(self, *leaves):
        tensors = iter(leaves[:self.count])
        outputs = [next(tensors) if kind == "value" else value for kind, value in self.output_leaves]
        output = pytree.tree_unflatten(outputs, self.out_spec)
        target = pytree.tree_unflatten(list(leaves[self.count:]), self.target_spec)
        return self.loss_fn(output, target)


def trace_loss(model_file, graph) -> LossGraph:
    """The traced loss for ``graph`` (a :class:`PipelineGraph` before any rewrite): its inputs are the model
    output's tensor leaves (meta tensors of the last stage's output shapes), then the target's leaves (the
    example target's first microbatch)."""
    from torch.export import Dim

    last = graph.stages[-1].graph
    values = list(last.output_node().args[0])
    positions = [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]
    fakes = [values[i].meta.get("val") for i in positions]
    kinds = [kind for kind, _value in graph.output_leaves]
    if len(fakes) != sum(1 for kind in kinds if kind == "value"):
        raise ContextParallelError("--cp: the model's outputs could not be matched to the last stage's values")
    symbols: dict = {}

    def example(fake):
        shape, dims = [], {}
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt):
                hint = size.node.hint if size.node.hint is not None else 4
                shape.append(int(hint))
                name = str(size.node.expr)
                if size.node.expr.is_Symbol:
                    dims[d] = symbols.setdefault(name, Dim(f"loss_{name}"))
                else:
                    dims[d] = Dim.AUTO
            else:
                shape.append(int(size))
        return torch.empty(shape, dtype=fake.dtype, device="meta"), dims

    inputs, dynamic = [], []
    for fake in fakes:
        tensor, dims = example(fake)
        inputs.append(tensor)
        dynamic.append(dims or None)
    bd = graph.batch_dim  # the samples' dim of the outputs and the target (1: [seq, batch])
    batch = inputs[0].shape[bd] if inputs and inputs[0].dim() > bd else None
    target = model_file.example_target()
    t_leaves, t_spec = pytree.tree_flatten(target)
    seq_sizes = {int(s.node.hint) for f in fakes for s in f.shape if isinstance(s, torch.SymInt)
                 and s.node.hint is not None}
    full_batch = None
    for leaf in t_leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > bd:
            full_batch = leaf.shape[bd]
            break
    for leaf in t_leaves:
        if not isinstance(leaf, torch.Tensor):
            raise ContextParallelError(f"--cp traces loss_fn with the example target, whose leaves must be "
                                       f"tensors (found {type(leaf).__name__})")
        if leaf.dim() > bd and leaf.shape[bd] == full_batch and batch is not None:
            leaf = leaf.narrow(bd, 0, batch).contiguous()  # one microbatch's, contiguous as the runtime cuts it
        inputs.append(leaf.to("meta"))
        dims = {d: Dim.AUTO for d, size in enumerate(leaf.shape) if d != bd and int(size) in seq_sizes}
        if graph.batch_symbol is not None and leaf.dim() > bd:
            dims[bd] = Dim.AUTO
        dynamic.append(dims or None)
    module = _Loss(model_file.module.loss_fn, graph.out_spec, graph.output_leaves, t_spec, len(fakes))
    try:
        program = torch.export.export(module, tuple(inputs),
                                      dynamic_shapes=(tuple(dynamic),) if any(dynamic) else None)
    except Exception as error:  # noqa: BLE001 - the user's loss function: say where it broke
        raise ContextParallelError(f"--cp traces the model file's loss_fn to combine it over the cp ranks, and "
                                   f"torch.export could not: {type(error).__name__}: {str(error)[:400]}") from error
    gm = program.graph_module
    user = set(program.graph_signature.user_inputs)
    where = _where(model_file.module.loss_fn)
    # what nothing reads goes (the loss's output object rebuilt in full: a DynamicCache's layers joined to empty
    # tensors by cat and detach_, which only the cache would read)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() and n.target is not torch.ops.aten.detach_.default)
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name not in user]:
        if node.users:  # a tensor the loss makes and reads (a constant export lifted into an input)
            raise ContextParallelError(f"--cp traces the model file's loss_fn to combine it over the cp ranks, and "
                                       f"it reads a constant tensor it makes ({node.name}, at "
                                       f"{where.splitlines()[0] if where else 'loss_fn'}): make "
                                       f"it from the output's or the target's tensors, or split without --cp")
        gm.graph.erase_node(node)  # made and not read (the empty tensors of a cache object the output rebuilds)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [f"output_{graph.output_leaves[p][1]}" for p in positions] + \
        (["target"] if len(t_leaves) == 1 else [f"target_{i}" for i in range(len(t_leaves))])
    for node, name in zip(placeholders, names):
        try:
            node._rename(name)
            node.target = node.name
        except Exception:  # noqa: BLE001 - another torch's fx: keep export's names
            pass
    for node in gm.graph.nodes:
        if node.op == "call_function" and where:
            node.meta["stack_trace"] = where  # export keeps the wrapper's frame; the line the user wrote is this
    inputs_map = {node.name: (positions[i] if i < len(fakes) else None) for i, node in enumerate(placeholders)}
    return LossGraph(gm.graph, inputs_map, t_spec, len(fakes))


def _where(function) -> str:
    """A stack-trace line of the loss function's definition (``File "model.py", line 42, in loss_fn``)."""
    import inspect

    try:
        lines, start = inspect.getsourcelines(function)
        path = inspect.getsourcefile(function)
    except (OSError, TypeError):
        return ""
    body = next((line.strip() for line in lines[1:] if line.strip() and not line.strip().startswith("#")),
                lines[0].strip())
    return f'File "{path}", line {start}, in {function.__name__}\n    {body}'

