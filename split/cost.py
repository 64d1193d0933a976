"""Cost estimates for the split step: FLOPs and memory per node, per segment and per stage, and the choice of
cuts that balances them.

FLOPs are counted per node of the traced graph from the values it carries (shapes, no compute, no parameter
data): formulas of our own for what torch's counter misses (attention on every sdpa backend including CPU's,
flex attention, grouped matmuls of routed experts), torch's formulas for its ops, and for a composite op
(``linear``, ``matmul``, ``einsum``) the op alone re-run on fake tensors under ``FlopCounterMode``. One op that
cannot be priced costs its own count, never the graph's; an op that does work without a formula is named
(:class:`FlopCount`). Elementwise work is not counted. Memory is what a stage holds in training:
parameters, their gradients, the optimizer's state (Adam: two fp32 tensors per parameter unless told
otherwise), and the activations of one microbatch times the microbatches the schedule keeps in flight.
Every floating value that carries a gradient is counted as an activation kept for backward (an upper bound:
autograd frees some of them early).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from tracepp.runtime.memory import concrete_int
from tracepp.split.pipeline_graph import Stage

ADAM_STATE_BYTES_PER_PARAM = 8  # exp_avg and exp_avg_sq, fp32 each
BACKWARD_FLOPS_FACTOR = 2  # backward of a matmul costs two matmuls (input and weight gradients)


# a concrete int for a size or FLOP count that may be symbolic (dynamic shapes): its traced hint, or for a
# data-dependent size its upper bound
as_int = concrete_int


def held_bytes(node) -> int:
    """Bytes a rank holds of a state placeholder: in its master dtype where the program was traced with it cast to
    the compute dtype (``pipeline_graph.MASTER_DTYPE``, ``--mixed-precision params``), else as traced."""
    from tracepp.split.pipeline_graph import MASTER_DTYPE

    val = node.meta.get("val")
    master = node.meta.get(MASTER_DTYPE)
    if master is None or not isinstance(val, torch.Tensor):
        return tensor_bytes(val)
    return tensor_bytes(val) // val.element_size() * master.itemsize


def tensor_bytes(val) -> int:
    """Bytes of one traced tensor value (fake or meta), 0 for anything else."""
    if not isinstance(val, torch.Tensor):
        return 0
    numel = 1
    for size in val.shape:
        numel *= as_int(size)
    return numel * val.element_size()


def _fake_mode_of(values: list):
    return next((v.fake_mode for v in values if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode")), None)


def node_flops(graph: fx.Graph) -> dict:
    """Forward FLOPs of every node of a traced graph (node name -> int): :func:`count_flops`' ``by_node``."""
    return count_flops(graph).by_node


def forward_flops(stage: Stage) -> int:
    """FLOPs of the stage's forward for the traced microbatch."""
    return sum(node_flops(stage.graph).values())


# -- counting FLOPs from the graph -------------------------------------------------------------------------------

def _shape(value) -> list:
    if isinstance(value, (list, tuple, torch.Size)):  # FlopCounterMode hands its formulas shapes
        return [as_int(size) for size in value]
    return [as_int(size) for size in value.shape]


def _numel(shape: list) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _attention_flops(query, key, value, *_rest, **_kwargs) -> int:
    """Scaled dot-product attention, dense: scores (q @ k^T) and their product with v, per query head (a
    grouped-query key/value head serves several query heads, each pays). Every sdpa backend, flex attention."""
    *batch, query_len, head_dim = _shape(query)
    key_len, value_dim = _shape(key)[-2], _shape(value)[-1]
    return 2 * _numel(batch) * query_len * key_len * (head_dim + value_dim)


def _grouped_mm_flops(mat_a, mat_b, *_rest, out=None, out_shape=None, **_kwargs) -> int:
    """Grouped matmul (routed experts): every row of ``mat_a`` meets one group's ``(K, N)`` matrix, so 2 x rows x
    K x N whatever the split into groups; 3-D x 3-D is a batched matmul; 2-D x 2-D groups split K."""
    a, b = _shape(mat_a), _shape(mat_b)
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[-1]
    return 2 * _numel(_shape(out if out is not None else out_shape)) * a[-1]


# op (namespace::name, or a higher-order op's name) -> FLOPs from its argument and output values
FORMULAS = {
    "aten::scaled_dot_product_attention": _attention_flops,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention_flops,
    "aten::_scaled_dot_product_flash_attention": _attention_flops,
    "aten::_scaled_dot_product_efficient_attention": _attention_flops,
    "aten::_scaled_dot_product_cudnn_attention": _attention_flops,
    "aten::_scaled_dot_product_attention_math": _attention_flops,
    "aten::_scaled_dot_product_fused_attention_overrideable": _attention_flops,
    "flex_attention": _attention_flops,
    "aten::_grouped_mm": _grouped_mm_flops,
    "transformers::grouped_mm_fallback": _grouped_mm_flops,
    "tracepp::grouped_mm": _grouped_mm_flops,  # the fallback as the rank scripts call it (split/expert_parallel.py)
}
def eager_flop_counter() -> FlopCounterMode:
    """``FlopCounterMode`` with the formulas it lacks (CPU sdpa, grouped matmuls): an eager count of a model's
    forward to check the graph's count against (the tests do)."""
    mapping = {}
    for name, formula in FORMULAS.items():
        namespace, _sep, op = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace, None), op, None) if op else None
        if packet is not None and packet not in flop_registry:
            mapping[packet] = formula
    return FlopCounterMode(display=False, custom_mapping=mapping)


# ops that never do arithmetic worth a warning (markers, asserts, shape bookkeeping)
_NO_WORK_NAMESPACES = ("tracepp", "_operator", "builtins")


def op_name(node: fx.Node) -> str:
    """``aten::mm``, ``transformers::grouped_mm_fallback``, or a higher-order op's name (``flex_attention``)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(target, "__name__", str(target))


@dataclass
class FlopCount:
    """Forward FLOPs of every node of a graph, and what the count could not see.

    ``by_node``: node name -> FLOPs. ``no_formula``: op -> nodes that do work (floating inputs of 2+ dims) with
    neither a formula nor a decomposition torch counts: counted as 0, named in one warning per op.
    ``failed``: op -> nodes whose single-op re-run on fake tensors raised (counted as 0; no FLOP op among them
    would have been missed silently: those are ``no_formula`` too when they do work). ``assumed``: symbol ->
    the expected value a data-dependent size was priced at, and why."""

    by_node: dict = field(default_factory=dict)
    no_formula: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    assumed: dict = field(default_factory=dict)

    def warnings(self) -> list:
        return [f"no FLOP formula for {op} ({count} node{'s' if count > 1 else ''}); counted as 0"
                for op, count in sorted(self.no_formula.items())]

    def record(self) -> dict:
        return {"no_formula": dict(sorted(self.no_formula.items())), "failed": dict(sorted(self.failed.items())),
                "assumed": self.assumed}


def _does_work(node: fx.Node) -> bool:
    """A node whose inputs include a floating tensor of 2+ dims: a matmul-like op could hide there."""
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2:
            return True
    return False


def _composite(name: str) -> bool:
    """An aten op that decomposes into others (linear, matmul, einsum, conv2d): re-run it to count its parts."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    except RuntimeError:
        return False


def _values(node: fx.Node):
    """The node's arguments with every input node replaced by its traced value."""
    def value_of(item):
        return item.meta.get("val") if isinstance(item, fx.Node) else item
    return fx.node.map_aggregate(node.args, value_of), fx.node.map_aggregate(node.kwargs, value_of)


def _rerun(node: fx.Node, fake_mode) -> int:
    """The op alone on its traced (fake) values under a fresh ``FlopCounterMode``."""
    args, kwargs = _values(node)
    with fake_mode, FlopCounterMode(display=False) as counter:
        node.target(*args, **kwargs)
    return counter.get_total_flops()


def count_flops(graph: fx.Graph) -> FlopCount:
    """Price every node of a traced graph from its traced values: a formula of :data:`FORMULAS`, else torch's
    FLOP formula for the op (``torch.utils.flop_counter``), else the op alone re-run on fake tensors under
    ``FlopCounterMode`` (a composite op such as ``linear`` counts as the matmuls it becomes). An op that cannot be
    re-run costs its own count, never the graph's. Elementwise ops are not counted (by design, as torch)."""
    result = FlopCount()
    values = [node.meta.get("val") for node in graph.nodes]
    fake_mode = _fake_mode_of(values)
    local: dict = {}  # an op on the same shapes, dtypes and arguments costs the same: each is priced once
    # torch's ops on static shapes price the same in every graph (the whole model's, each stage's, the manifest's):
    # remembered across graphs (_PRICED); a symbolic dim ("s0") may stand for another size in another trace, and
    # another library's op may behave otherwise another time: those in this graph only
    if len(_PRICED) > _MAX_PRICED:
        _PRICED.clear()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        key = _signature(node)
        cached = None if key is None else local.get(key, _PRICED.get(key))
        if cached is not None:
            flops, fails, missing = cached
            result.by_node[node.name] = flops
            for counts, found in ((result.failed, fails), (result.no_formula, missing)):
                if found:
                    counts[found] = counts.get(found, 0) + 1
            continue
        failed_before, missing_before = dict(result.failed), dict(result.no_formula)
        name = op_name(node)
        flops = None
        try:
            if name in FORMULAS:
                args, kwargs = _values(node)
                flops = FORMULAS[name](*args, out=node.meta.get("val"), **kwargs)
            else:
                packet = getattr(node.target, "overloadpacket", None)
                registered = flop_registry.get(packet) if packet is not None else None
                if registered is not None:
                    args, kwargs = _values(node)
                    flops = registered(*args, **kwargs, out_val=node.meta.get("val"))
                elif name.startswith("aten::") and not _composite(name):
                    flops = 0  # a primitive without a formula: elementwise, shape or data movement
                elif name.split("::")[0] in _NO_WORK_NAMESPACES or not _does_work(node) or fake_mode is None:
                    flops = 0
                else:
                    flops = _rerun(node, fake_mode)
                    if flops == 0 and not name.startswith("aten::"):
                        result.no_formula[name] = result.no_formula.get(name, 0) + 1
        except Exception:  # this op alone cannot be priced: it costs its own count, not the graph's
            result.failed[name] = result.failed.get(name, 0) + 1
            if _does_work(node) and not name.startswith("aten::") or name in FORMULAS:
                result.no_formula[name] = result.no_formula.get(name, 0) + 1
            flops = 0
        result.by_node[node.name] = _concrete(flops, result.assumed)
        if key is not None:
            shared = key[-1] and (name in FORMULAS or name.startswith("aten::"))
            (_PRICED if shared else local)[key] = (result.by_node[node.name],
                                                  name if result.failed != failed_before else None,
                                                  name if result.no_formula != missing_before else None)
    return result


_PRICED: dict = {}  # count_flops' prices of torch's ops on static shapes, by signature
_MAX_PRICED = 200_000


def _signature(node: fx.Node):
    """What a node's FLOP count depends on: its op and its arguments, tensors as (shape, dtype); None where an
    argument is neither (never shared). Its last item says whether every size in it is an int (static)."""
    symbolic = []

    def plain(item):
        if isinstance(item, fx.Node):
            val = item.meta.get("val")
            if isinstance(val, torch.Tensor):
                if not all(isinstance(d, int) for d in val.shape):
                    symbolic.append(item)
                return ("T", tuple(str(d) for d in val.shape), str(val.dtype))
            if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat)):
                if isinstance(val, (torch.SymInt, torch.SymFloat)):
                    symbolic.append(item)
                return ("V", str(val))
            raise TypeError
        if isinstance(item, (list, tuple)):
            return tuple(plain(i) for i in item)
        if isinstance(item, dict):
            return tuple((k, plain(v)) for k, v in item.items())
        if item is None or isinstance(item, (int, float, bool, str, torch.dtype, torch.device, torch.memory_format,
                                             torch.layout)):
            return repr(item)
        raise TypeError
    try:
        key = (str(node.target), plain(node.args), plain(node.kwargs), str(node.meta.get("val", "").__class__))
    except TypeError:
        return None
    out = node.meta.get("val")
    outs = out if isinstance(out, (list, tuple)) else [out]
    static = not symbolic and all(not isinstance(v, torch.Tensor) or all(isinstance(d, int) for d in v.shape)
                                  for v in outs)
    return key + (static,)


def _concrete(value, assumed: dict) -> int:
    """An int for a FLOP count that may be symbolic: the traced hint of a dynamic dim; a data-dependent size
    (no hint: tokens routed to one expert) at its expected value, recorded in ``assumed``."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    if value.node.has_hint():
        return int(value.node.hint)
    import sympy

    expr = value.node.expr
    shape_env = value.node.shape_env
    substitutions = {}
    for symbol in expr.free_symbols:
        hint = getattr(shape_env, "backed_var_to_val", None)
        hint = (hint if hint is not None else shape_env.var_to_val).get(symbol)
        if hint is not None:
            substitutions[symbol] = hint
            continue
        if str(symbol) not in assumed:
            assumed[str(symbol)] = _expected(symbol, shape_env)
        substitutions[symbol] = assumed[str(symbol)]["expected"]
    return int(sympy.ceiling(expr.xreplace(substitutions)))


def _expected(symbol, shape_env) -> dict:
    """The value a data-dependent size is priced at: the most the data can give (its proven upper bound).
    transformers' grouped experts keep every routed row in one static shape (tokens x top-k, spread over the
    experts), so their count needs no assumption; a size that does depend on the data is named in the manifest."""
    bound = shape_env.var_to_range.get(symbol)
    try:
        upper = int(bound.upper)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return {"expected": 1, "why": "data-dependent size without an upper bound: priced at 1"}
    return {"expected": upper, "why": f"data-dependent size, at most {upper}: priced at that bound"}



def inflight_microbatches(schedule: Optional[str], stage_index: int, num_stages: int, num_microbatches: int,
                          training: bool = True) -> int:
    """Microbatches whose activations a stage keeps at once: all of them under GPipe, ``min(num_stages -
    stage_index, num_microbatches)`` under 1F1B and the schedules built on it (the first stage warms up the
    most); one in forward-only runs."""
    if not training:
        return 1
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage_index, num_microbatches)


@dataclass
class SegmentCost:
    """The cost of a run of nodes (a segment, or a whole stage) for one microbatch."""

    forward_flops: int = 0
    num_params: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0  # per microbatch

    def __add__(self, other: "SegmentCost") -> "SegmentCost":
        return SegmentCost(self.forward_flops + other.forward_flops, self.num_params + other.num_params,
                           self.param_bytes + other.param_bytes, self.activation_bytes + other.activation_bytes)


def stage_estimate(cost: SegmentCost, inflight: int, training: bool = True,
                   optimizer_bytes_per_param: int = ADAM_STATE_BYTES_PER_PARAM) -> dict:
    """Plain-data estimate of one stage: compute (forward and backward FLOPs) and the bytes it holds."""
    grad_bytes = cost.param_bytes if training else 0
    optimizer_bytes = cost.num_params * optimizer_bytes_per_param if training else 0
    activation_bytes = cost.activation_bytes * inflight
    flops = cost.forward_flops * ((1 + BACKWARD_FLOPS_FACTOR) if training else 1)
    return {"forward_flops": cost.forward_flops, "step_flops_per_microbatch": flops,
            "param_bytes": cost.param_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes,
            "activation_bytes_per_microbatch": cost.activation_bytes, "inflight_microbatches": inflight,
            "activation_bytes": activation_bytes,
            "memory_bytes": cost.param_bytes + grad_bytes + optimizer_bytes + activation_bytes}


def per_rank_estimate(stage: Stage, graph, layout, training: bool = True,
                      optimizer_bytes_per_param: int = ADAM_STATE_BYTES_PER_PARAM) -> dict:
    """A stage's estimate as one of its ranks holds it under ``layout`` (a ``runtime.mesh.Layout``): the
    parameters from the stage graph's own annotations (after tensor and expert parallelism rewrote them to this
    rank's shards: tp pieces, ep's experts), FSDP's (and HSDP's) share of the others over dp, their gradients
    and optimizer state alike; the activations of the microbatches in flight as before."""
    estimate = dict(stage.estimate)
    experts = set((graph.expert_parallel or {}).get("params", {}))
    shard = {"fsdp": layout.dp, "hsdp": layout.dp_shard or 1}.get(layout.dp_mode, 1) if layout.dp > 1 else 1
    params = count = 0
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, stage.state):
        ref = graph.state[name]
        if ref.kind != "parameter":
            continue
        val = node.meta.get("val")
        divisor = 1 if ref.fqn in experts else shard  # experts stay outside FSDP: already 1/ep
        params += tensor_bytes(val) / divisor
        count += as_int(val.numel()) / divisor if isinstance(val, torch.Tensor) else 0
    grads = params if training else 0
    optimizer = count * optimizer_bytes_per_param if training else 0
    estimate.update(param_bytes=int(params), grad_bytes=int(grads), optimizer_bytes=int(optimizer), per_rank=True,
                    memory_bytes=int(params + grads + optimizer + estimate["activation_bytes"]))
    return estimate


def imbalance(amounts: list) -> Optional[float]:
    """max / mean of per-stage amounts (1.0 is perfect balance), None when there is nothing to compare."""
    if not amounts or not any(amounts):
        return None
    return max(amounts) / (sum(amounts) / len(amounts))


def choose_cuts(segments: list, num_stages: int, memory_of) -> list:
    """Where to cut a sequence of segments into ``num_stages`` contiguous non-empty stages.

    ``segments`` are SegmentCosts in execution order; ``memory_of(stage_index, cost)`` gives the bytes a stage
    with that summed cost holds. The cuts minimise the largest stage's FLOPs, and among equal ones the largest
    stage's memory (so an embedding, which has no counted FLOPs, still weighs). Returns the segment indices
    where stages 1..num_stages-1 begin. Dynamic programming over (stage, first segment): O(stages x segments^2).
    """
    count = len(segments)
    if num_stages > count:
        raise ValueError(f"cannot cut {count} segments into {num_stages} stages")
    prefix = [SegmentCost()]
    for segment in segments:
        prefix.append(prefix[-1] + segment)

    def span(start: int, end: int) -> SegmentCost:
        total, before = prefix[end], prefix[start]
        return SegmentCost(total.forward_flops - before.forward_flops, total.num_params - before.num_params,
                           total.param_bytes - before.param_bytes,
                           total.activation_bytes - before.activation_bytes)

    worst = (float("inf"), float("inf"))
    # best[stage_index][end]: (max flops, max memory) of stages 0..stage_index covering segments [0, end)
    best = [[worst] * (count + 1) for _ in range(num_stages)]
    cut_at = [[0] * (count + 1) for _ in range(num_stages)]
    for end in range(1, count + 1):
        cost = span(0, end)
        best[0][end] = (cost.forward_flops, memory_of(0, cost))
    flops = [p.forward_flops for p in prefix]
    for stage_index in range(1, num_stages):
        for end in range(stage_index + 1, count + 1):
            # the last stage's first segment from the nearest down: its FLOPs only grow, so once they alone pass
            # the best found no earlier start can do better; among equal candidates the earliest start wins (<=)
            for start in range(end - 1, stage_index - 1, -1):
                if flops[end] - flops[start] > best[stage_index][end][0]:
                    break
                before = best[stage_index - 1][start]
                if before == worst:
                    continue
                most = max(before[0], flops[end] - flops[start])
                if most > best[stage_index][end][0]:
                    continue  # more FLOPs than the best so far: worse whatever its memory (not counted)
                candidate = (most, max(before[1], memory_of(stage_index, span(start, end))))
                if candidate <= best[stage_index][end]:
                    best[stage_index][end], cut_at[stage_index][end] = candidate, start
    cuts, end = [], count
    for stage_index in range(num_stages - 1, 0, -1):
        end = cut_at[stage_index][end]
        cuts.append(end)
    return sorted(cuts)
