"""What each stage holds per microbatch, counted on fake tensors as the runtime runs it.

:func:`profile_stages` runs every stage graph forward and backward on ``FakeTensorMode`` tensors (shapes and
dtypes, no storage, no compute) the way a rank's executor does (``runtime/executor.py``): the received
activations as fresh leaves over their receive buffers (cast from the wire dtype under mixed precision), the
stage module of the runtime itself (``runtime/stages.StageModule``: autocast in the compute dtype, activation
checkpointing, sequence-parallel shards), the loss on the last stage, the outputs freed once sent, autograd's
own engine for the backward (zero-bubble schedules: the executor's own ``WeightSplit``, input gradients
first, weight gradients later). :class:`~tracepp.runtime.memory.LiveMemory` counts every storage alive at each
moment, each once. So what is counted is what autograd keeps, whatever the op: an SDPA kernel's log-sum-exp,
not S x S scores; the bf16 copy of a weight autocast saves for its matmul; a checkpointed stage's inputs only.

Per stage, for one microbatch (bytes; ``STAGE_FIELDS``): the receive buffers it takes, the forward's peak above
what was live before it, what the forward leaves alive (``kept``: saved for backward and the outputs), the
outputs freed once sent, the gradient buffers it receives, the backward's peak and what it leaves (the first
backward of a step allocates the parameters' gradients; later ones add into them), the input gradients held
until sent. Every live storage is also attributed to the graph node that made it (``kept_by_node``), which
gives the tuner the kept bytes of each segment of the graph. Stages with the same graph (the repeated middle
of a model) are profiled once.

The timeline over a rank's actions that turns these into a peak per rank is :mod:`tracepp.codegen.peak`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tracepp.codegen.workers import forked_map, workers_for
from tracepp.runtime import context_parallel, expert_parallel, tensor_parallel
from tracepp.runtime.actions import Action
from tracepp.runtime.memory import LiveMemory, storages_of
from tracepp.runtime.shm_p2p import DEFAULT_RING_MB
from tracepp.runtime import precision as precision_policy
from tracepp.runtime.stages import StageModule
from tracepp.split.cost import as_int, held_bytes
from tracepp.split.partition import SEGMENT, STATE_FQN
from tracepp.split.pipeline_graph import MASTER_DTYPE

RING_BYTES = int(DEFAULT_RING_MB * 2**20)  # run.py --shm-ring-mb's default: one ring per pair of CPU ranks on a host
STAGE_FIELDS = ("received", "forward_peak", "kept", "outputs", "freed_at_send", "grad_received", "backward_peak",
                "backward_peak_first", "after_backward", "after_backward_first", "input_grads", "grads",
                "input_backward_peak", "after_input_backward", "weight_backward_peak", "weight_backward_peak_first",
                "after_weight_backward", "after_weight_backward_first")


@dataclass
class MemoryOptions:
    """What changes a stage's memory besides the graph: the compute ``precision`` (fp32, bf16, fp16, fp8) and how
    it applies (``mixed_precision``: params, where the graphs were traced with the parameters in the compute dtype and
    a stage computes with their copy; autocast, fp32 parameters cast per op; ``runtime/precision.py``), the
    activation checkpointing of each stage (``recompute[stage]``: none, full, selective), whether the plan
    splits backwards into I and W (zero-bubble schedules), the tp and ep sizes (the collectives' fake
    implementations read them), and with expert parallelism the routing's imbalance planned for: a rank receives
    ``expert_imbalance`` times the rows it sends for its experts (1: balanced routing; dropless routing moves
    every row, so a rank whose experts are busier than the mean receives more: run.py's metrics report the busiest
    expert over the mean as ``experts max/mean``, which ``tracepp split --expert-imbalance`` takes)."""

    precision: str = "fp32"
    mixed_precision: str = "params"  # params: the graphs were traced with the compute dtype's parameters; autocast
    fp8_recipe: str = "tensorwise"
    recompute: Optional[list] = None
    split_backward: bool = False
    tp: int = 1
    ep: int = 1
    expert_imbalance: float = 1.0  # rows an expert-parallel rank receives, over the balanced count
    device: str = "cpu"  # where the job runs: what its collectives and optimizer allocate
    cp: int = 1

    def mode(self, stage_index: int) -> str:
        return self.recompute[stage_index] if self.recompute else "none"


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for leaf in pytree.tree_leaves(tensors):
        if isinstance(leaf, torch.Tensor):
            for storage in storages_of(leaf):
                if id(storage) not in seen:
                    seen.add(id(storage))
                    total += storage.nbytes()
    return total


def _concrete_shape(val) -> list:
    return [as_int(size) for size in val.shape]


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def cuda_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """``scaled_dot_product_attention`` as a CUDA device runs it, for the planning run on CPU fake tensors: on CPU
    torch falls back to the math kernel wherever its flash kernel does not apply (a value head dim unlike the
    query's, as MLA has; a mask), which keeps the S x S scores and their softmax for backward; on CUDA the
    memory-efficient kernel takes those (flash where it can, keeping the same: the output and a log-sum-exp), so a
    plan for ``--device cuda`` counts that. A boolean mask becomes the additive bias the kernel reads (torch does
    the same), and grouped key/value heads are repeated to the query heads as the efficient kernel needs."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, query.requires_grad or key.requires_grad or value.requires_grad,
        dropout_p, is_causal, scale=scale)[0]


def float8_linear(x, weight, bias=None):
    """``aten.linear`` as torchao's float8 training allocates it, for the planning run of ``--precision fp8`` (CPU
    fake tensors, no torchao): the float8 casts of the input and the weight live through the matmul beside its
    output (in the input's dtype); autograd keeps what torchao's ``matmul_with_hp_or_float8_args`` saves, the
    high-precision input and weight, as a bf16 linear does."""
    if not precision_policy.fp8_eligible(weight):
        return torch.ops.aten.linear.default(x, weight, bias)
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)  # noqa: F841  (held through the matmul, then freed)
    w8 = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)  # noqa: F841
    return torch.ops.aten.linear.default(x, weight, bias)


class _Labelled:
    """Runs a stage graph node by node as its generated code does, attributing each storage made to the node that
    made it; values are dropped after their last use. ``regions``: the runs of nodes the rank script calls as
    block functions (``codegen.stage_code.find_blocks``), run through
    the runtime's own wrapper of block functions (``recompute._checkpointed``), which checkpoints them one by one
    as the stage's checkpointing says."""

    def __init__(self, module: fx.GraphModule, tracker: LiveMemory, regions=(), device: str = "cpu",
                 float8: bool = False):
        from tracepp.runtime.recompute import _checkpointed

        self.graph = module.graph
        self.tracker = tracker
        self.device = device
        self.float8 = float8  # --precision fp8: linears as torchao's float8 allocates them (float8_linear)
        self.nodes = [n for n in self.graph.nodes if n.op not in ("placeholder", "output")]
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in self.graph.nodes if n.op == "output")
        self.region_at, self.skipped = {}, set()
        for block in regions:
            self.region_at[block.nodes[0]] = (block, _checkpointed(self._region(block)))
            self.skipped.update(block.nodes[1:] + block.hoisted)

    def _call(self, node: fx.Node, env: dict):
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        target = node.target
        if target is _SDPA and self.device == "cuda":  # the kernel CUDA runs, not the CPU fake's choice
            target = cuda_attention
        elif self.float8 and target is torch.ops.aten.linear.default:
            target = float8_linear
        with self.tracker.labelled(node.name):
            return target(*args, **kwargs)

    @staticmethod
    def _last_uses(nodes: list, keep: set) -> dict:
        last: dict = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                last[arg] = node
        drop: dict = {}
        for value, user in last.items():
            if value not in keep:
                drop.setdefault(user, []).append(value)
        return drop

    def _region(self, block):
        drop = self._last_uses(block.nodes, set(block.outputs))

        def run(*inputs):
            env = dict(zip(block.inputs, inputs))
            for node in block.nodes:
                env[node] = self._call(node, env)
                for value in drop.get(node, ()):
                    env.pop(value, None)
            return tuple(env[output] for output in block.outputs)
        return run

    def run(self, *args):
        env = dict(zip(self.placeholders, args))
        order = []
        for node in self.nodes:  # a region runs where its first node is, after the sizes hoisted out of it
            if node in self.skipped:
                continue
            if node in self.region_at:
                block, _wrapped = self.region_at[node]
                order += [("node", size) for size in block.hoisted] + [("region", node)]
            else:
                order.append(("node", node))
        uses: dict = {}  # value -> the index of its last use in ``order`` (region inputs and the output too)
        for index, (kind, item) in enumerate(order):
            reads = self.region_at[item][0].inputs if kind == "region" else item.all_input_nodes
            for value in reads:
                uses[value] = index
        drop: dict = {}
        for value, index in uses.items():
            drop.setdefault(index, []).append(value)
        returned = set(self.output.all_input_nodes)
        try:
            for index, (kind, item) in enumerate(order):
                if kind == "node":
                    env[item] = self._call(item, env)
                else:
                    block, wrapped = self.region_at[item]
                    for output, value in zip(block.outputs, wrapped(*[env[i] for i in block.inputs])):
                        env[output] = value
                for value in drop.get(index, ()):
                    if value not in returned:
                        env.pop(value, None)
            return fx.node.map_arg(self.output.args[0], env.__getitem__)
        finally:  # a checkpoint's recomputation stops early by raising: its values go, as a frame's would
            env.clear()


def block_regions(stage_graph: fx.Graph) -> list:
    """The runs of ``stage_graph``'s nodes that its rank script calls as block functions (``find_blocks``: every
    block is one, ``group_blocks``)."""
    from tracepp.codegen.stage_code import find_blocks

    return find_blocks(stage_graph)


def _runnable_graph(graph: fx.Graph, on_meta: bool = False) -> fx.GraphModule:
    """A copy of the stage graph as the rank script runs it: autocast off where the model turned it off, export's
    metadata asserts dropped (what ``codegen.stage_code`` does before printing). ``on_meta``: the devices its ops
    name (the CPU the program was traced for) made ``meta``, where the count runs on meta tensors."""
    from tracepp.codegen.stage_code import _RunDeviceType, _autocast_off_regions
    from tracepp.split.rules import drop_metadata_asserts

    copy = fx.Graph()
    output = copy.graph_copy(graph, {}, return_output_node=True)
    copy.output(output[0] if isinstance(output, tuple) else output)
    _autocast_off_regions(copy)
    drop_metadata_asserts(copy)
    for node in copy.nodes:  # the rank script's autocast device, ``RUN_DEVICE.type``: the fake tensors' device here
        if node.op == "call_function" and node.args and isinstance(node.args[0], _RunDeviceType):
            node.update_arg(0, "cpu")
        elif on_meta and node.op == "call_function":
            node.args = fx.node.map_aggregate(node.args, _to_meta_device)
            node.kwargs = fx.node.map_aggregate(node.kwargs, _to_meta_device)
    copy.lint()
    return fx.GraphModule(torch.nn.Module(), copy)


def _to_meta_device(value):
    if isinstance(value, torch.device) and value.type != "meta":
        return torch.device("meta")
    return value


# Ops a stage graph holds that torch decomposes (CompositeImplicitAutograd) before any fake or meta kernel runs,
# into ops that do not depend on the tensors' device: a stage made of these and of ops with kernels of their own
# allocates on meta tensors exactly what it allocates on CPU fake ones (the fake mode runs those same meta kernels).
# A composite that chooses by device (``rms_norm``: a fused kernel on CUDA; convolutions; ``batch_norm``) is not
# here, and a stage holding one is counted on fake tensors. ``scaled_dot_product_attention`` is meta-safe where the
# count substitutes the kernel CUDA runs (``cuda_attention``, ``--device cuda``): on meta tensors torch would run
# the math kernel, on CPU fake ones its flash kernel.
META_SAFE_COMPOSITES = frozenset({
    "aten::linear", "aten::matmul", "aten::einsum", "aten::outer", "aten::reshape", "aten::reshape_as",
    "aten::view_as", "aten::expand_as", "aten::contiguous", "aten::chunk", "aten::split.sizes",
    "aten::tensor_split.sections", "aten::flatten.using_ints", "aten::unflatten.int", "aten::swapaxes",
    "aten::movedim.int", "aten::mT", "aten::to.dtype", "aten::to.device", "aten::to.dtype_layout", "aten::type_as",
    "aten::size.int", "aten::_has_compatible_shallow_copy_type", "aten::__and__.Tensor", "aten::__or__.Tensor",
    "aten::where.ScalarOther", "aten::where.ScalarSelf", "aten::where.Scalar", "aten::diff", "aten::square",
    "aten::float_power.Tensor_Scalar", "aten::arctan2", "aten::absolute", "aten::negative", "aten::multiply.Tensor",
    "aten::divide.Tensor", "aten::subtract.Tensor", "aten::greater.Scalar", "aten::less.Scalar", "aten::argsort",
    "aten::repeat_interleave.self_int", "aten::layer_norm", "aten::softmax.int", "aten::log_softmax.int",
    "aten::cross_entropy_loss",
    # tracepp's own composites of the same device-independent ops (``runtime/tensor_parallel.py``,
    # ``context_parallel.py``); ``tracepp::grouped_mm`` chooses torch's kernel by device and is not here
    "tracepp::tp_vocab_embedding", "tracepp::cp_shard", "tracepp::cp_positions",
})


def _on_meta_why_not(stage_graph: fx.Graph, options: "MemoryOptions", loss=None) -> Optional[str]:
    """None where one stage's count may run on meta tensors rather than fake ones (the same bytes, a third of the
    time: ``profile_stage``), else why not: autocast (its CPU dispatch key does not see meta tensors), or an op that
    could choose its kernel by device, in the stage graph or in the model file's loss (``loss``: a graph of it,
    :func:`_loss_graph`, or why it has none)."""
    if options.mixed_precision == "autocast" and precision_policy.compute_dtype(options.precision) is not None:
        return "autocast"
    if isinstance(loss, str):
        return loss
    return _ops_why_not(stage_graph, options) or (_ops_why_not(loss, options) if loss is not None else None)


def _ops_why_not(graph: fx.Graph, options: "MemoryOptions") -> Optional[str]:
    import operator

    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return f"{getattr(target, '__name__', target)} is not an aten op"
        name = target.name()
        if target is _SDPA:
            if options.device != "cuda":
                return "attention on CPU"
            continue
        if (torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
                and name not in META_SAFE_COMPOSITES):
            return f"{name} may choose its kernel by device"
    return None


def _loss_graph(loss_fn, stage, graph, target, compute):
    """The model file's ``loss_fn`` as the last stage calls it, traced before dispatch (``make_fx`` with
    ``pre_dispatch``: composite ops kept) on meta tensors of the stage's output and the target: its ops, for
    :func:`_on_meta_why_not`. A string (why not) where it cannot be traced so (it reads a value, say)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def meta_of(value, floating_to=None):
        dtype = floating_to if floating_to is not None and value.dtype.is_floating_point else value.dtype
        return torch.empty(_concrete_shape(value), dtype=dtype, device="meta")

    returned = list(stage.graph.output_node().args[0])
    leaves = []
    for position, (kind, const) in enumerate(graph.output_leaves):
        value = returned[position] if position < len(returned) else None
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        leaves.append(meta_of(val, compute) if kind == "value" and isinstance(val, torch.Tensor) else
                      (const if kind != "value" else value))
    target = pytree.tree_map_only(torch.Tensor, meta_of, target)
    spec = graph.out_spec
    try:
        traced = make_fx(lambda outputs, target: loss_fn(pytree.tree_unflatten(outputs, spec), target),
                         pre_dispatch=True)(leaves, target)
    except Exception as error:  # noqa: BLE001
        return f"the model file's loss does not trace on meta tensors ({type(error).__name__})"
    return traced.graph


def _structure_key(stage, graph, options: MemoryOptions, is_last: bool) -> str:
    """Stages whose graphs hold the same ops on the same shapes (a model's repeated middle) keep the same bytes."""
    digest = hashlib.sha256(repr((options.precision, options.mixed_precision, options.mode(stage.index),
                                  options.split_backward, is_last)).encode())
    def plain(value):  # names (a value's, a block's) do not change what is allocated; numbers and dtypes do
        if isinstance(value, fx.Node):
            return "node"
        if isinstance(value, str):
            return "name"
        return str(value)

    position = {node: index for index, node in enumerate(stage.graph.nodes)}
    for node in stage.graph.nodes:
        val = node.meta.get("val")
        text = (node.op, str(node.target) if node.op != "placeholder" else "",
                repr(fx.node.map_aggregate(node.args, plain)), repr(fx.node.map_aggregate(node.kwargs, plain)),
                [position[arg] for arg in node.all_input_nodes],
                (str(val.dtype), [str(s) for s in val.shape], val.requires_grad)
                if isinstance(val, torch.Tensor) else type(val).__name__)
        if node.op == "placeholder":
            ref = graph.state.get(node.name)
            text += (ref.kind if ref is not None else "input",)
        digest.update(repr(text).encode())
    return digest.hexdigest()


class _ShapesOnly(TorchDispatchMode):
    """Ops whose fake implementation runs the CPU kernel on zeros, where that kernel refuses what the accelerator
    takes (``histc`` of int32: Hugging Face MoE counts tokens per expert so off the CPU, and a model traced on
    meta follows that branch): their outputs' shapes and dtypes only, which is all memory needs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.histc.default:
            return torch.empty((args[1] if len(args) > 1 else (kwargs or {}).get("bins", 100),),
                               dtype=args[0].dtype, device=args[0].device)
        return func(*args, **(kwargs or {}))


class _StageRun:
    """One stage run as a rank's executor runs it (see the module doc), on fake tensors."""

    def __init__(self, stage, graph, trainable: set, options: MemoryOptions, tracker: LiveMemory, loss_fn, target,
                 out_spec, output_leaves, is_last: bool, sequence_shards: bool, on_meta: bool = False):
        self.stage, self.graph, self.tracker = stage, graph, tracker
        self.is_last = is_last
        self.loss_fn, self.target, self.out_spec, self.output_leaves = loss_fn, target, out_spec, output_leaves
        self.compute = compute = precision_policy.compute_dtype(options.precision)
        autocast = options.mixed_precision == "autocast"
        self.wire = compute if autocast else None  # params: boundaries travel as traced
        placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
        state_nodes = placeholders[:len(stage.state)]
        tensors, spec_state = {}, []
        for node, name in zip(state_nodes, stage.state):
            ref = graph.state[name]
            val = node.meta["val"]
            # the rank holds the master weight (fp32) where the graph was traced with its compute copy
            tensor = torch.empty(_concrete_shape(val), dtype=node.meta.get(MASTER_DTYPE) or val.dtype)
            if ref.kind == "parameter":
                tensor = torch.nn.Parameter(tensor, requires_grad=ref.fqn in trainable)
            fqn = node.meta.get(STATE_FQN, ref.fqn)
            tensors.setdefault(fqn, tensor)
            spec_state.append({"fqn": fqn, "kind": ref.kind, "persistent": ref.persistent})
        runnable = _runnable_graph(stage.graph, on_meta)
        regions = block_regions(runnable.graph)
        interpreter = _Labelled(runnable, tracker, regions, options.device, options.precision == "fp8")
        self.module = StageModule({"index": stage.index, "state": spec_state},
                                  lambda *args: interpreter.run(*args), tensors)
        self.module.recompute_blocks = bool(regions)
        self.module.autocast_dtype = compute if autocast else None
        if not autocast and compute is not None:  # the copies a step computes with, made before its first forward
            cast = precision_policy.CastWeights(list(self.module.parameters()), compute)
            if cast:
                self.module.cast_weights = cast
                tracker.register(cast.make(), "parameters")
        self.module.recompute = options.mode(stage.index) if options.mode(stage.index) != "none" else False
        self.pool = []  # receive buffers given back after a backward: the executor keeps them for reuse
        self.module.sequence_shards = sequence_shards
        self.module.context_shards = options.cp > 1  # keys and values kept as this rank's shard (runtime/context_parallel)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        rest = placeholders[len(stage.state):]
        roots, rest = rest[:len(stage.root_inputs)], rest[len(stage.root_inputs):]
        received, sizes = rest[:len(stage.received)], rest[len(stage.received):]
        self.roots = [torch.zeros(_concrete_shape(n.meta["val"]), dtype=n.meta["val"].dtype)
                      if isinstance(n.meta.get("val"), torch.Tensor) else n.meta.get("val") for n in roots]
        self.received_meta = [(n.meta["val"], graph.values[name].meta.requires_grad)
                              for n, (_producer, name) in zip(received, stage.received)]
        self.sizes = [as_int(n.meta["val"]) for n in sizes]
        self.tracker.register([p for p in self.module.parameters()] + [b for b in self.module.buffers()],
                              "parameters")
        self.tracker.register(self.roots, "activations")
        self.returned_only = []
        output = next(n for n in stage.graph.nodes if n.op == "output")
        self.returned_only = [isinstance(n, fx.Node) and len(n.users) == 1 and n.op != "placeholder"
                              for n in output.args[0]]
        self.split = options.split_backward
        if self.split:
            from tracepp.runtime.executor import WeightSplit

            self.weight_split = WeightSplit(self.module.compute_parameters())
            self.weight_split.matmul_recipes = False  # its bit-for-bit check reads values fake tensors lack
        self.in_flight = {}

    def _wire(self, dtype):
        return self.wire if self.wire is not None and dtype.is_floating_point else dtype

    def receive(self, mb: int) -> list:
        with self.tracker.labelled("received"):
            buffers = [torch.empty(_concrete_shape(val), dtype=self._wire(val.dtype)) for val, _g in self.received_meta]
        self.in_flight[mb] = {"buffers": buffers}
        return buffers

    def forward(self, mb: int) -> None:
        state = self.in_flight.setdefault(mb, {"buffers": []})
        inputs = list(state["buffers"])
        grad_slots = [k for k, (_val, grad) in enumerate(self.received_meta) if grad]
        for slot in grad_slots:
            inputs[slot] = inputs[slot].detach().requires_grad_(True)
        received = inputs
        if self.wire is not None:
            received = [value.to(val.dtype) for value, (val, _g) in zip(inputs, self.received_meta)]
        out = self.module(*self.roots, *received, *self.sizes)
        state.update(inputs=inputs, wanted=[inputs[k] for k in grad_slots], out=out, loss=None,
                     out_meta=[(t.shape, t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else None
                               for t in out])
        if self.is_last:
            leaves = [out[i] if kind == "value" else const for i, (kind, const) in enumerate(self.output_leaves)]
            if self.compute is not None:  # mixed precision: the loss in fp32
                leaves = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]
            if self.loss_fn is not None and self.target is not None:
                output = pytree.tree_unflatten(leaves, self.out_spec)
                with self.tracker.labelled("loss"):
                    state["loss"] = self.loss_fn(output, self.target).float() * 0.5

    def send(self, mb: int) -> None:
        """The outputs the executor frees once sent (``RankExecutor._choose_deallocatable``)."""
        out = self.in_flight[mb]["out"]
        for pos, tensor in enumerate(out[:len(self.returned_only)]):
            if not (isinstance(tensor, torch.Tensor) and self.returned_only[pos] and tensor.requires_grad):
                continue
            if tensor._base is not None or tensor.grad_fn is None or hasattr(tensor.grad_fn, "_saved_result"):
                continue
            tensor.data = torch.empty((0,), dtype=tensor.dtype)

    def receive_grads(self, mb: int) -> None:
        state = self.in_flight[mb]
        with self.tracker.labelled("received"):
            state["grad_buffers"] = [torch.empty(meta[0], dtype=self._wire(meta[1])) if meta and meta[2] else None
                                     for meta in state["out_meta"]] if not self.is_last else []

    def _tensors_and_grads(self, state):
        from tracepp.runtime.executor import _run_backward  # noqa: F401  (the engine call used below)

        if self.is_last:
            return ([state["loss"]], [None]) if state["loss"] is not None else ([], [])
        tensors, grads = [], []
        for tensor, buffer in zip(state["out"], state["grad_buffers"]):
            if buffer is not None:
                tensors.append(tensor)
                grads.append(buffer.to(tensor.dtype))
        return tensors, grads

    def _release(self, mb: int) -> None:
        state = self.in_flight.pop(mb)
        self.pool += state.get("buffers", []) + [b for b in state.get("grad_buffers", []) if b is not None]

    def backward(self, mb: int, part: str = "full") -> None:
        from tracepp.runtime.executor import WeightSplit, _run_backward

        if part == "weight" and mb not in self.in_flight:  # its I ran the whole backward (selective, as the executor)
            return
        if part == "input" and self.module.recompute == "selective":
            self.backward(mb, "full")
            return
        state = self.in_flight[mb]
        if part == "weight":
            pending, tensors, grads = state.pop("pending")
            WeightSplit.weight_backward(pending, tensors, grads)
            del pending, tensors, grads
            self._release(mb)
            self.module.weights_used(False)
            return
        tensors, grads = self._tensors_and_grads(state)
        wanted = state["wanted"]
        leaves = self.module.compute_parameters()  # the compute copies under --mixed-precision params
        if part == "full":
            if tensors:
                _run_backward(tensors, grads, False, (), True)
            found = [t.grad for t in wanted]
            del tensors, grads
            self._release(mb)
        else:
            if tensors and wanted and leaves:
                self.weight_split.use(leaves)
                found, pending, keep = self.weight_split.input_backward(tensors, grads, wanted)
            else:
                found = (_run_backward(tensors, grads, True, tuple(wanted), False) if tensors and wanted
                         else [None] * len(wanted))
                pending, keep = WeightSplit.from_outputs(leaves), True
            state["pending"] = (pending, tensors, grads) if keep else (pending, None, None)
            if not keep:
                state["out"], state["loss"] = None, None
            del tensors, grads, pending
        self.module.weights_used(False)  # the copies' gradients into the masters' (fp32), as the executor does
        self.input_grads = [g if g is not None else torch.zeros_like(w) for g, w in zip(found, wanted)]


def _measure(tracker: LiveMemory, action) -> tuple:
    """(peak above the bytes live before ``action()``, live bytes after minus before)."""
    before = tracker.now
    tracker.reset_peak()
    action()
    return tracker.peak - before, tracker.now - before


def profile_stage(stage, graph, trainable: set, options: MemoryOptions, loss_fn=None, target=None,
                  is_last: bool = False, training: bool = True, sequence_shards: bool = False,
                  fake: bool = True, meta: Optional[bool] = None) -> dict:
    """One stage's figures (``STAGE_FIELDS``, bytes, one microbatch) and ``kept_by_node`` (node name -> bytes
    it leaves alive after the forward), from two microbatches run forward, sent and run backward on fake
    tensors: the first backward of a step allocates the gradients, the second adds into them.

    Where every op of the stage allocates the same whatever the device (``_on_meta_why_not``), the run is on meta
    tensors instead: the same meta kernels the fake mode runs, without its wrapping and caching (a 671B model's
    stage 2 - 3x faster); a stage that a meta tensor cannot run (an op with no meta kernel, a value read) is run
    again on fake tensors. ``meta``: None chooses so, False never, True insists (the tests compare the two).
    ``fake=False`` runs the same on real (uninitialised) tensors: the tests hold the fake count against it."""
    args = (stage, graph, trainable, options, loss_fn, target, is_last, training, sequence_shards)
    def why_not():
        loss = None
        if is_last and loss_fn is not None and target is not None:  # the loss runs on the last stage only
            with _planning_collectives(options.tp, options.ep, options.expert_imbalance, options.cp):  # cp: sharded
                loss = _loss_graph(loss_fn, stage, graph, target, precision_policy.compute_dtype(options.precision))
        return _on_meta_why_not(stage.graph, options, loss)

    if fake and meta is not False and (meta or why_not() is None):
        try:
            return _profile_stage(*args, "meta")
        except Exception:  # noqa: BLE001 - what meta tensors cannot run, fake ones can
            if meta:
                raise
    return _profile_stage(*args, "fake" if fake else "real")


def _profile_stage(stage, graph, trainable: set, options: MemoryOptions, loss_fn, target, is_last: bool,
                   training: bool, sequence_shards: bool, on: str) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = {"fake": lambda: FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()),
            "meta": lambda: torch.device("meta"), "real": contextlib.nullcontext}[on]()
    tracker = LiveMemory(track_inputs=False)
    figures = dict.fromkeys(STAGE_FIELDS, 0)
    shapes_only = _ShapesOnly() if on == "fake" else contextlib.nullcontext()
    with mode, shapes_only, tracker, _planning_collectives(options.tp, options.ep, options.expert_imbalance,
                                                           options.cp):
        fake_target = None
        if target is not None:
            fake_target = pytree.tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), target)
        run = _StageRun(stage, graph, trainable, options, tracker, loss_fn, fake_target, graph.out_spec,
                        graph.output_leaves, is_last, sequence_shards, on == "meta")
        # full backwards: the first of a step (it allocates the gradients), then one that adds into them; with
        # zero-bubble schedules also input then weight backwards (a W first of a step, then one after a B)
        count = 4 if options.split_backward else 2
        grad_context = contextlib.nullcontext() if training else torch.no_grad()
        with grad_context:
            before = tracker.now
            for mb in range(count):
                run.receive(mb)
            figures["received"] = (tracker.now - before) // count
            figures["received_sizes"] = [_nbytes(b) for b in run.in_flight[0]["buffers"]]
            figures["forward_peak"], figures["kept"] = _measure(tracker, lambda: run.forward(0))
            live_after = tracker.live_by_label()
            figures["outputs"] = _nbytes(run.in_flight[0]["out"]) if not is_last else 0
            for mb in range(1, count):
                _measure(tracker, lambda: run.forward(mb))
        if not training:
            figures["kept_by_position"] = _by_position(stage.graph, live_after)
            return figures
        if not is_last:
            figures["freed_at_send"] = -_measure(tracker, lambda: run.send(0))[1]
            for mb in range(1, count):
                run.send(mb)
            before = tracker.now
            for mb in range(count):
                run.receive_grads(mb)
            figures["grad_received"] = (tracker.now - before) // count
            figures["grad_received_sizes"] = [_nbytes(b) for b in run.in_flight[0]["grad_buffers"] if b is not None]

        def backward(mb: int, part: str, names: tuple) -> None:
            peak, after = _measure(tracker, lambda: run.backward(mb, part))
            figures[names[0]], figures[names[1]] = max(figures[names[0]], peak), after
            if part != "weight":
                figures["input_grads"] = _nbytes(run.input_grads)
                run.input_grads = None

        grads_before = _nbytes([p.grad for p in run.params])
        order = [(0, "full", "_first"), (1, "full", "")]
        if options.split_backward:
            order = [(0, "input", ""), (0, "weight", "_first"), (1, "full", ""), ("zero", None, None),
                     (2, "full", "_first"), (3, "input", ""), (3, "weight", "")]
        for mb, part, suffix in order:
            if mb == "zero":  # a new step: the gradients were taken by the optimizer
                figures["grads"] = _nbytes([p.grad for p in run.params]) - grads_before
                for param in run.params:
                    param.grad = None
                continue
            names = {"full": ("backward_peak", "after_backward"), "input": ("input_backward_peak", "after_input_backward"),
                     "weight": ("weight_backward_peak", "after_weight_backward")}[part]
            backward(mb, part, (names[0] + suffix, names[1] + suffix))
        if not options.split_backward:
            figures["grads"] = _nbytes([p.grad for p in run.params]) - grads_before
    figures["kept_by_position"] = _by_position(stage.graph, live_after)
    return figures


def _by_position(graph: fx.Graph, by_label: dict) -> dict:
    """Live bytes by the position of the node that made them in ``graph`` (stages with the same structure share
    their figures, and a position names the same node in each); ``"loss"`` for the loss function's."""
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    out: dict = {}
    for label, nbytes in by_label.items():
        key = "loss" if label == "loss" else position.get(label)
        if key is not None and nbytes:
            out[key] = out.get(key, 0) + nbytes
    return out


def kept_by_segment(stage, figures: dict) -> dict:
    """segment index (``split.partition.SEGMENT``) -> bytes the stage's forward leaves for backward there; the
    loss's go to the stage's last segment."""
    nodes = list(stage.graph.nodes)
    out: dict = {}
    last = None
    for key, nbytes in (figures.get("kept_by_position") or {}).items():
        if key == "loss":
            continue
        segment = nodes[int(key)].meta.get(SEGMENT) if int(key) < len(nodes) else None
        if segment is not None:
            out[segment] = out.get(segment, 0) + nbytes
    for node in nodes:
        if node.meta.get(SEGMENT) is not None:
            last = node.meta[SEGMENT]
    loss = (figures.get("kept_by_position") or {}).get("loss", 0)
    if loss and last is not None:
        out[last] = out.get(last, 0) + loss
    return out


@contextlib.contextmanager
def _planning_collectives(tp_size: int = 1, ep_size: int = 1, imbalance: float = 1.0, cp_size: int = 1):
    """The tp, ep and cp ops' fake implementations read the group sizes from the runtime's process state; planning
    sets them to the layout's (the stage graphs already hold this rank's local shapes)."""
    tp, ep, cp = dict(tensor_parallel._STATE), dict(expert_parallel._STATE), dict(context_parallel._STATE)
    tensor_parallel._STATE.update(group=None, size=tp_size, rank=0)
    expert_parallel._STATE.update(group=None, size=ep_size, rank=0, planning=max(imbalance, 1.0))
    context_parallel._STATE.update(group=None, size=cp_size, rank=0)
    try:
        yield
    finally:
        for state, old in ((tensor_parallel._STATE, tp), (expert_parallel._STATE, ep), (context_parallel._STATE, cp)):
            state.clear()
            state.update(old)


def profile_stages(graph, model, loss_fn, target, options: MemoryOptions, training: bool = True,
                   sequence_shards: bool = False, cache=None) -> list:
    """:func:`profile_stage` for every stage of ``graph`` (a :class:`~tracepp.split.pipeline_graph.PipelineGraph`):
    ``model`` gives which parameters train, ``loss_fn`` and ``target`` (one microbatch's) the last stage's loss.
    A stage that cannot run on fake tensors gets ``{"error": why}`` instead (the caller falls back)."""
    profiles = StageProfiles(graph, model, loss_fn, target, options, training, sequence_shards, cache)
    modes = [options.mode(stage.index) for stage in graph.stages]
    profiles.prefetch(list(enumerate(modes)))
    return [profiles.figures(index, mode) for index, mode in enumerate(modes)]


class StageProfiles:
    """Each stage's figures (:func:`profile_stage`) under a checkpointing mode, counted when first asked for:
    stages with the same structure (a model's repeated middle) once, and the ones :meth:`prefetch` is given
    several at a time in worker processes where they are many and large (``codegen.workers``)."""

    def __init__(self, graph, model, loss_fn, target, options: MemoryOptions, training: bool = True,
                 sequence_shards: bool = False, cache=None):
        self.graph, self.loss_fn, self.target, self.options = graph, loss_fn, target, options
        self.training, self.sequence_shards = training, sequence_shards
        self.trainable = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        self.done = cache if cache is not None else {}
        self._keys: dict = {}

    def _options(self, mode: str) -> MemoryOptions:
        return dataclasses.replace(self.options, recompute=[mode] * self.graph.num_stages)

    def key(self, index: int, mode: str) -> str:
        if (index, mode) not in self._keys:
            stage = self.graph.stages[index]
            self._keys[(index, mode)] = _structure_key(stage, self.graph, self._options(mode),
                                                       index == self.graph.num_stages - 1)
        return self._keys[(index, mode)]

    def count(self, index: int, mode: str) -> dict:
        """One stage's figures under ``mode``, counted here."""
        last = index == self.graph.num_stages - 1
        try:
            return profile_stage(self.graph.stages[index], self.graph, self.trainable, self._options(mode),
                                 self.loss_fn, self.target if last else None, last, self.training,
                                 self.sequence_shards)
        except Exception as error:  # noqa: BLE001  (never fail a split for its memory figure)
            return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}

    def prefetch(self, wanted: list) -> None:
        """Count the (stage index, mode) pairs of ``wanted`` not counted yet, each distinct structure once."""
        jobs = {}
        for index, mode in wanted:
            key = self.key(index, mode)
            if key not in self.done and key not in jobs:
                jobs[key] = (index, mode)
        if not jobs:
            return
        nodes = sum(len(self.graph.stages[index].graph.nodes) for index, _mode in jobs.values())
        workers = workers_for(len(jobs), nodes)
        if workers > 1:
            try:
                found = _in_workers(self, list(jobs.values()), workers)
            except Exception:  # noqa: BLE001 - a pool that cannot start: count them here
                found = None
            if found is not None:
                self.done.update(zip(jobs, found))
                return
        for key, (index, mode) in jobs.items():
            self.done[key] = self.count(index, mode)

    def figures(self, index: int, mode: str) -> dict:
        key = self.key(index, mode)
        if key not in self.done:
            self.done[key] = self.count(index, mode)
        return dict(self.done[key])

    def counted(self, index: int, mode: str) -> bool:
        return self.key(index, mode) in self.done


def _in_workers(profiles: StageProfiles, jobs: list, workers: int) -> list:
    """:meth:`StageProfiles.count` of each job in ``workers`` forked processes (they inherit the stage graphs;
    the figures come back as plain data), the largest stage graphs first."""
    return forked_map(lambda job: profiles.count(*job), jobs, workers,
                      weight=lambda job: len(profiles.graph.stages[job[0]].graph.nodes))


# -- a plan's memory: every stage's figures, what each rank holds, its peak ---------------------------------------

def stage_state(stage, graph, layout, trainable_fqns=None, options: Optional[MemoryOptions] = None) -> dict:
    """What a rank holds of one stage's parameters and buffers between steps, from the stage graph's placeholders
    (already this rank's tp pieces and ep experts): ``param_bytes`` held (FSDP's 1/dp shard of the parameters it
    manages, DDP's whole copy, routed experts whole: FSDP leaves them alone), in the dtype the rank holds them in (the
    fp32 master weights under ``--mixed-precision params``, whose graphs were traced in the compute dtype),
    ``unsharded_bytes`` (the copy the stage computes with, held from its first forward to its last backward of the
    step: the one FSDP gathers of those it shards, and DDP, on FSDP2's machinery, of those it replicates, in the
    compute dtype under the params policy (float8 for the linears FSDP gathers so under fp8 with tensorwise
    scaling), and without an engine the compute copy ``precision.CastWeights`` makes under that policy),
    ``grad_bytes_at_rest`` (the trainable parameters' gradients after the step's reduction, in the masters' dtype),
    ``gathered_bytes`` (FSDP's flat all-gather output and reduce-scatter input: the parameters it shards, each padded
    on dim 0 to a multiple of the shard count, as FSDP2 pads them; every 1/dp figure here is that padded shard) and
    ``trainable``: ``[(fqn, numel held, dtype)]`` for the optimizer."""
    experts = set((graph.expert_parallel or {}).get("params", {})) if layout.ep > 1 else set()
    wrapped = layout.dp > 1  # fully_shard (FSDP, HSDP) or replicate (DDP on FSDP2's machinery): both gather a copy
    fsdp = wrapped and layout.dp_mode in ("fsdp", "hsdp")
    shard = (layout.dp if layout.dp_mode == "fsdp" else (layout.dp_shard or 1)) if fsdp else 1
    # fp8 with tensorwise scaling under FSDP: torchao all-gathers the linears' weights in float8
    float8_gather = (options is not None and options.precision == "fp8" and options.fp8_recipe == "tensorwise"
                     and fsdp)
    held = unsharded = gathered = grads = 0
    trainable = []
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"][:len(stage.state)]
    for node, name in zip(placeholders, stage.state):
        ref = graph.state[name]
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        nbytes = held_bytes(node)  # in the dtype the rank holds it in
        computed = as_int(val.numel()) * val.element_size()  # in the dtype the stage computes with
        if ref.kind != "parameter":
            held += nbytes
            continue
        sharded = fsdp and ref.fqn not in experts
        own, numel = nbytes, as_int(val.numel())
        if sharded:  # FSDP2 shards dim 0, padded to a multiple of the shard count (torch.chunk's first piece)
            rows = as_int(val.shape[0]) if val.dim() else 1
            per_row = numel // rows if rows else 0
            numel = -(-rows // shard) * per_row
            own = numel * (node.meta.get(MASTER_DTYPE) or val.dtype).itemsize
            gathered += numel * shard * val.element_size()  # the flat all-gather output and reduce-scatter input hold the padding too
        held += own
        if wrapped and ref.fqn not in experts:
            unsharded += as_int(val.numel()) if float8_gather and _float8_linear_weight(node) else computed
        elif node.meta.get(MASTER_DTYPE) is not None:  # a compute copy made without an engine (CastWeights)
            unsharded += computed
        if trainable_fqns is None or ref.fqn in trainable_fqns:
            grads += own
            trainable.append((node.meta.get(STATE_FQN, ref.fqn), numel, node.meta.get(MASTER_DTYPE) or val.dtype))
    return {"param_bytes": held, "unsharded_bytes": unsharded, "gathered_bytes": gathered, "grad_bytes_at_rest": grads,
            "trainable": trainable}


def _float8_linear_weight(node) -> bool:
    """A parameter placeholder read as the weight of an ``aten.linear`` that torchao's float8 takes
    (``precision.fp8_eligible``): what fp8's FSDP all-gather moves in float8."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or any(
            as_int(size) % precision_policy.FP8_ALIGNMENT for size in val.shape):
        return False
    return any(user.target is torch.ops.aten.linear.default and len(user.args) > 1 and user.args[1] is node
               for user in node.users)


def optimizer_figures(trainable: list, make_optimizer, device: str = "cpu") -> dict:
    """``{"state_bytes", "step_peak"}`` of the optimizer ``make_optimizer(named_params)`` builds for a rank's
    trainable parameters (``[(fqn, numel, dtype)]``), from one step on fake tensors: the state it keeps, and the
    temporaries of its step above that (on ``device`` cuda with torch's foreach kernels, as CUDA runs them: a
    temporary as large as all the parameters)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not trainable or make_optimizer is None:
        return {"state_bytes": 0, "step_peak": 0}
    tracker = LiveMemory()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        named = [(fqn, torch.nn.Parameter(torch.empty(numel, dtype=dtype))) for fqn, numel, dtype in trainable]
        optimizer = make_optimizer(named)
        if device == "cuda":  # torch's optimizers take their foreach kernels on CUDA tensors (the fake ones are CPU)
            for group in optimizer.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
        key = _optimizer_key(optimizer)
        if key not in _OPTIMIZER_STEPS:  # ranks holding alike stages group alike and step alike: counted once
            for _fqn, param in named:
                param.grad = torch.zeros_like(param)
            with tracker.as_category("optimizer"):
                before = tracker.now
                tracker.reset_peak()
                optimizer.step()
                _OPTIMIZER_STEPS[key] = (int(tracker.now - before), int(max(tracker.peak - tracker.now, 0)))
    state, step_peak = _OPTIMIZER_STEPS[key]
    return {"state_bytes": state, "step_peak": step_peak, "name": type(optimizer).__name__}


_OPTIMIZER_STEPS: dict = {}  # _optimizer_key -> (state bytes, step peak)


def _optimizer_key(optimizer) -> tuple:
    """What one step's bytes depend on: the optimizer's class, and per parameter group its options (foreach,
    fused, amsgrad, ...) and its parameters' sizes and dtypes, in order (not their names or values)."""
    def plain(value):
        return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)

    return (type(optimizer).__qualname__, tuple(
        (tuple(sorted((k, plain(v)) for k, v in group.items() if k != "params")),
         tuple((p.numel(), p.dtype) for p in group["params"])) for group in optimizer.param_groups))


def _max_in_flight(actions: list, stage_index: int) -> int:
    from tracepp.runtime.recompute import max_in_flight

    return max_in_flight([str(a) for a in actions], stage_index)


def _stage_entries(graph, profiles: list, layout, trainable_fqns: set, options: MemoryOptions) -> tuple:
    """(each stage's manifest entry: its profile and what a rank holds of it; its trainable parameters; notes)."""
    stages, trainable, notes = [], [], []
    for stage, figures in zip(graph.stages, profiles):
        entry, held, note = _stage_entry(graph, stage, figures, layout, trainable_fqns, options.mode(stage.index),
                                         options)
        stages.append(entry)
        trainable.append(held)
        notes += [note] if note else []
    return stages, trainable, notes


def _stage_entry(graph, stage, figures: dict, layout, trainable_fqns: set, mode: str, options) -> tuple:
    """(one stage's manifest entry under checkpointing ``mode``, its trainable parameters, a note or None)."""
    state = stage_state(stage, graph, layout, trainable_fqns, options)
    held = state.pop("trainable")
    entry = {k: v for k, v in figures.items() if k != "kept_by_position"}
    entry.update(state)
    entry["recompute"] = mode
    note = None
    if "error" in figures:
        note = (f"stage {stage.index}: memory not counted on fake tensors ({figures['error']}); "
                f"its activations are the split's upper bound, and its rank's peak is a bound, not a count")
        entry["bound"] = True
        bound = stage.estimate.get("activation_bytes_per_microbatch", 0)
        entry.update(dict.fromkeys(STAGE_FIELDS, 0), kept=bound, forward_peak=bound, backward_peak=bound,
                     backward_peak_first=bound, after_backward=-bound, after_backward_first=-bound,
                     input_backward_peak=bound, weight_backward_peak=bound, weight_backward_peak_first=bound)
    entry["kept_by_segment"] = {str(k): v for k, v in kept_by_segment(stage, figures).items()}
    return entry, held, note


class _ByMode:
    """``by_mode[mode][stage]``: a stage's manifest entry under a checkpointing mode, its profile counted when
    first asked for (:class:`StageProfiles`)."""

    def __init__(self, graph, profiles: StageProfiles, layout, trainable_fqns: set, options):
        self.graph, self.profiles, self.layout, self.trainable_fqns = graph, profiles, layout, trainable_fqns
        self.options = options
        self._entries: dict = {}

    def entry(self, index: int, mode: str) -> dict:
        if (index, mode) not in self._entries:
            figures = self.profiles.figures(index, mode)
            self._entries[(index, mode)] = _stage_entry(self.graph, self.graph.stages[index], figures, self.layout,
                                                        self.trainable_fqns, mode, self.options)[0]
        return self._entries[(index, mode)]

    def __getitem__(self, mode: str) -> list:
        return _Stages(self, mode)

    def complete(self, mode: str) -> bool:
        """Whether every stage was counted under ``mode``."""
        return all(self.profiles.counted(index, mode) for index in range(self.graph.num_stages))

    def items(self):
        return [(mode, self[mode]) for mode in ALTERNATIVE_MODES if self.complete(mode)]

    def __bool__(self) -> bool:
        return True


class _Stages:
    def __init__(self, by_mode: _ByMode, mode: str):
        self.by_mode, self.mode = by_mode, mode

    def __getitem__(self, index: int) -> dict:
        return self.by_mode.entry(index, self.mode)

    def __len__(self) -> int:
        return self.by_mode.graph.num_stages

    def __iter__(self):
        return (self[index] for index in range(len(self)))


def _rank_peaks(plan: dict, stages: list, trainable: list, layout, make_optimizer, training: bool,
                optimizers: dict, device: str = "cpu", only: Optional[set] = None) -> list:
    """Each pipeline rank's peak (``codegen.peak.rank_peak``) with its optimizer's figures (``optimizers``:
    rank -> figures, filled on first use and reused for other checkpointing). ``only``: these ranks' (None for the
    others, whose stages' entries may be None)."""
    from tracepp.codegen.peak import rank_peak

    stage_to_rank = plan["stage_to_rank"]
    ranks = []
    for rank in range(plan["num_ranks"]):
        if only is not None and rank not in only:
            ranks.append(None)
            continue
        mine = {s: stages[s] for s, r in enumerate(stage_to_rank) if r == rank}
        if rank not in optimizers:
            seen, held = set(), []
            for s in mine:
                for item in trainable[s]:
                    if item[0] not in seen:  # a weight two stages of this rank share is one parameter
                        seen.add(item[0])
                        held.append(item)
            figures = (optimizer_figures(held, make_optimizer, device) if training
                       else {"state_bytes": 0, "step_peak": 0})
            optimizers[rank] = dict(figures, numel=sum(item[1] for item in held))
        optimizer = optimizers[rank]
        actions = plan["actions"].get(str(rank), plan["actions"].get(rank, []))
        releases = (plan.get("releases") or {}).get(str(rank), (plan.get("releases") or {}).get(rank))
        peak = rank_peak(actions, mine, optimizer, layout.dp_mode, layout.dp, releases, device)
        bound = sorted(s for s in mine if mine[s].get("bound"))
        if bound:  # a stage that could not run on fake tensors: its figures are the split's upper bound
            peak["bound"], peak["bound_stages"] = True, bound
        if device == "cpu":  # shared-memory rings, one per rank this one receives from (outside torch's tensors)
            parsed = [Action.parse(str(a)) for a in actions]
            peers = {a.peer for a in parsed if a.kind in ("RECV_F", "RECV_B")}
            peak["rings_bytes"] = len({stage_to_rank[p] for p in peers if p is not None} - {rank}) * RING_BYTES
        peak["optimizer"] = dict(optimizer)  # numel: the parameters it updates on this rank
        ranks.append(peak)
    return ranks


ALTERNATIVE_MODES = ("none", "selective", "full")
# the share of a stage's forward its backward runs again: full checkpointing recomputes the whole forward,
# torchtitan's selective policy the ops between the matmuls, attention and collectives (measured on CPU, Llama
# hidden 512 and 1024: 0.22 - 0.47 of a forward, 0.80 - 0.99 for full; benchmarks/studies/recompute_cost.py)
RECOMPUTE_SHARE = {"none": 0.0, "selective": 0.25, "full": 1.0}
NEXT_MODE = {"none": "selective", "selective": "full"}


def plan_memory(graph, model, plan: dict, layout, options: MemoryOptions, loss_fn=None, target=None,
                make_optimizer=None, training: bool = True, memory_limit=None, all_modes: bool = False) -> dict:
    """The manifest's ``memory``: every stage's figures (:func:`profile_stages` and :func:`stage_state`), and per
    pipeline rank its peak over the plan's timeline with its parts (``tracepp.codegen.peak``), the same on every
    data- and tensor-parallel replica of that rank; ``alternatives``: each rank's peak under every stage at
    none, selective and full checkpointing (what run.py names when a job does not fit). Sets each stage's
    ``estimate`` from the counted figures, and each segment's ``memory`` (kept bytes and temporaries per
    checkpointing mode, the tuner's). ``options.recompute`` None: each stage's checkpointing is chosen so that
    every rank fits ``memory_limit`` (:func:`choose_checkpointing`; ``checkpointing`` in the result)."""
    sequence_shards = layout.tp > 1 and layout.sequence_parallel
    trainable_fqns = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    counts = StageProfiles(graph, model, loss_fn, target, options, training, sequence_shards)
    by_mode = _ByMode(graph, counts, layout, trainable_fqns, options)
    optimizers: dict = {}
    every = range(graph.num_stages)
    trainable = [stage_state(stage, graph, layout, trainable_fqns, options)["trainable"] for stage in graph.stages]
    if all_modes and training:  # the tuner's figures: every stage under every mode
        counts.prefetch([(s, mode) for mode in ALTERNATIVE_MODES for s in every])
    chosen = None
    if options.recompute is None and training:
        counts.prefetch([(s, "none") for s in every])
        chosen = choose_checkpointing(graph, plan, by_mode, trainable, layout, make_optimizer, optimizers,
                                      options.device, memory_limit)
        options = dataclasses.replace(options, recompute=chosen["modes"])
    counts.prefetch([(s, options.mode(s)) for s in every])
    profiles = [counts.figures(s, options.mode(s)) for s in every]
    stages, trainable, notes = _stage_entries(graph, profiles, layout, trainable_fqns, options)
    ranks = _rank_peaks(plan, stages, trainable, layout, make_optimizer, training, optimizers, options.device)
    if memory_limit is not None and training and max(r["peak_bytes"] for r in ranks) > memory_limit:
        counts.prefetch([(s, mode) for mode in ALTERNATIVE_MODES for s in every])  # to say what would fit
    alternatives = {}
    for mode, entries in by_mode.items():
        if [mode] * graph.num_stages != [options.mode(s.index) for s in graph.stages]:
            alternatives[mode] = [r["peak_bytes"] for r in _rank_peaks(plan, list(entries), trainable, layout,
                                                                        make_optimizer, training, optimizers,
                                                                        options.device)]
    _segment_memory(graph, by_mode)
    stage_to_rank = plan["stage_to_rank"]
    for stage, entry in zip(graph.stages, stages):
        rank = stage_to_rank[stage.index]
        actions = plan["actions"].get(str(rank), plan["actions"].get(rank, []))
        inflight = _max_in_flight(actions, stage.index) if training else 1
        numel = optimizers[rank].get("numel", 0)
        share = sum(item[1] for item in trainable[stage.index]) / numel if numel else 0.0
        estimate = dict(stage.estimate)
        estimate.update(activation_bytes_per_microbatch=entry["kept"], inflight_microbatches=inflight,
                        activation_bytes=entry["kept"] * inflight, param_bytes=entry["param_bytes"],
                        grad_bytes=entry["grad_bytes_at_rest"] if training else 0,
                        optimizer_bytes=int(ranks[rank]["optimizer"]["state_bytes"] * share), counted=True)
        estimate["memory_bytes"] = (estimate["param_bytes"] + estimate["grad_bytes"] + estimate["optimizer_bytes"]
                                    + estimate["activation_bytes"])
        stage.estimate = estimate
    optimizer_name = next((r["optimizer"].get("name") for r in ranks if r["optimizer"].get("name")), None)
    return {"options": {"precision": options.precision, "mixed_precision": options.mixed_precision,
                        "recompute": [options.mode(s.index) for s in graph.stages],
                        "split_backward": options.split_backward, "optimizer": optimizer_name,
                        "expert_imbalance": options.expert_imbalance if layout.ep > 1 else None,
                        "device": options.device},
            "method": METHOD, "stages": stages, "ranks": ranks, "alternatives": alternatives, "notes": notes,
            "checkpointing": chosen, "modes_counted": [mode for mode, _entries in by_mode.items()]}


def choose_checkpointing(graph, plan: dict, by_mode: dict, trainable: list, layout, make_optimizer,
                         optimizers: dict, device: str, memory_limit) -> dict:
    """Each stage's activation checkpointing so that every rank's peak fits ``memory_limit`` bytes: from none
    everywhere, while a rank is over, one of its stages goes further (none -> selective -> full; straight to full
    where selective saves nothing: it keeps every matmul's output, which bf16 stage code without autocast's casts
    may not otherwise keep, e.g. the logits beside the loss's fp32 copy), the move that saves the most of that
    rank's peak per FLOP it recomputes (``RECOMPUTE_SHARE`` of its forward). The schedule decides the order: 1F1B's
    first stage keeps pp microbatches in flight and gains most, its last stage keeps one. ``{"modes": [...],
    "fits": bool, "peaks": [...], "limit": bytes}``."""
    shares, following = RECOMPUTE_SHARE, NEXT_MODE
    stage_to_rank = plan["stage_to_rank"]
    modes = ["none"] * graph.num_stages

    of_rank = [[s for s, r in enumerate(stage_to_rank) if r == rank] for rank in range(plan["num_ranks"])]
    known: dict = {}  # (rank, its stages' modes) -> its peak: a trial changes one stage, so one rank's peak

    def peaks_of(current: list) -> list:
        keys = [(rank, tuple(current[s] for s in stages)) for rank, stages in enumerate(of_rank)]
        wanted = {rank for rank, key in enumerate(keys) if key not in known}
        if wanted:
            entries = [by_mode[mode][s] if stage_to_rank[s] in wanted else None for s, mode in enumerate(current)]
            found = _rank_peaks(plan, entries, trainable, layout, make_optimizer, True, optimizers, device, wanted)
            known.update((keys[rank], found[rank]["peak_bytes"]) for rank in wanted)
        return [known[key] for key in keys]

    peaks = peaks_of(modes)
    if memory_limit is not None and max(peaks) > memory_limit:  # what the search will try, counted together
        over = {rank for rank, peak in enumerate(peaks) if peak > memory_limit}
        if hasattr(by_mode, "profiles"):  # a plan's lazily counted modes (a dict of figures: already counted)
            by_mode.profiles.prefetch([(s, mode) for s, r in enumerate(stage_to_rank) if r in over
                                       for mode in ("selective", "full")])
    while memory_limit is not None and max(peaks) > memory_limit:
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        best = None
        for stage in (s for s, r in enumerate(stage_to_rank) if r == worst and modes[s] in following):
            further = following[modes[stage]]
            while further is not None:  # the next mode, and the ones past it
                trial = list(modes)
                trial[stage] = further
                found = peaks_of(trial)
                saved = peaks[worst] - found[worst]
                flops = max(graph.stages[stage].estimate.get("forward_flops", 0), 1)
                score = saved / ((shares[further] - shares[modes[stage]]) * flops)
                if saved > 0 and (best is None or score > best[0]):
                    best = (score, trial, found)
                further = following.get(further)
        if best is None:
            break
        _score, modes, peaks = best
    return {"modes": modes, "fits": memory_limit is None or max(peaks) <= memory_limit, "peaks": peaks,
            "limit": memory_limit}


SEGMENT_FIELDS = ("kept", "forward_peak", "backward_peak", "backward_peak_first")


def _segment_memory(graph, by_mode: dict) -> None:
    """Each segment of the split's table gets ``memory``: per checkpointing mode, the bytes its nodes keep per
    microbatch (``kept``) and the temporaries of the stage it lies in (a stage's are about those of its largest
    block, which the tuner takes for a stage of other segments)."""
    if not graph.segments or not by_mode:
        return
    for index, segment in enumerate(graph.segments):
        figures = {}
        for mode, entries in by_mode.items():
            stage = segment.get("stage")
            entry = entries[stage] if stage is not None and stage < len(entries) else None
            if entry is None:
                continue
            figures[mode] = {"kept": int(entry.get("kept_by_segment", {}).get(str(index), 0)),
                             **{key: int(entry.get(key, 0)) for key in SEGMENT_FIELDS if key != "kept"}}
        segment["memory"] = figures


METHOD = ("each stage run forward and backward on fake (or meta) tensors as the rank's executor runs it (runtime "
          "StageModule: autocast, checkpointing; autograd's engine), every live tensor storage counted once; each "
          "rank's action list walked with those figures for the worst moment of a step after the first and of the "
          "optimizer step (codegen/peak.py)")
