"""Run one rank's action list for one training (or forward-only) step: no optimizer, no files, no argparse.

The action list is compiled once, at start-up, into a list of closures: each closure already holds the
stage, the peer rank, the value names and the shape functions it needs, so a step is a plain loop with no
lookups by string and no metadata exchange. Runs of consecutive communication actions are posted together
(``batch_isend_irecv`` on NCCL) and waited on only right before the compute that needs them; a send is
waited on (and its tensor dropped) at the release points the rank script lists (``RELEASES``: where the plan
proves its receive was posted, derived at plan time by ``replay``), the rest at the end of the step.

The stages come in as modules (see ``stages.StageModule``); what to do with the gradients they accumulate is
the caller's business (``pipeline.Pipeline``, then the training loop in ``launch``).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from torch.autograd.graph import GradientEdge

from .actions import Action
from .failure import PipelineError, stall_message
from .shapes import activation_key, compile_shape, gradient_key

_DIRECTION_TAG = {"F": 0, "B": 1}
# tags are (direction, producer, consumer, value index along that edge): a stage sends at most this many
# tensors to one consumer per microbatch (checked when the edges are built)
MAX_VALUES_PER_EDGE = 512
_BACKWARD_PART = {"B": "full", "I": "input", "W": "weight"}


def parse_action(text: str):
    """'0F1' -> (0, 'F', 1, None); '0SEND_F1>2' -> (0, 'SEND_F', 1, 2) (``actions.Action`` as a plain tuple)."""
    return tuple(Action.parse(text))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _shapes_from_manifest(manifest: dict):
    """The rank script's ``boundary_shapes`` rebuilt from the manifest (for callers without a rank script)."""
    fns = {}
    for name, v in manifest["values"].items():
        for consumer in v["consumers"]:
            fns[activation_key(name, v["producer"])] = fns[gradient_key(name, consumer)] = compile_shape(v["shape"])
    sizes = {item["name"]: compile_shape([item["expr"]])
             for stage in manifest["stages"] for item in stage.get("sym_inputs", [])}

    def shapes(**symbols):
        result = {name: fn(symbols) for name, fn in fns.items()}
        result.update({name: fn(symbols)[0] for name, fn in sizes.items()})
        return result
    return shapes


class StageActivations:
    """What one step keeps for one stage of this rank: its wiring and, per microbatch, inputs, outputs,
    gradients and receive buffers. The stage's computation is its module (``stages.StageModule``)."""

    def __init__(self, spec: dict, module, is_last: bool):
        self.index = spec["index"]
        self.fn = module
        self.root_leaf_indices = spec["root_leaf_indices"]
        self.received = spec["received"]  # [{producer, name, shape, dtype, requires_grad}]
        self.received_index = {(r["producer"], r["name"]): i for i, r in enumerate(self.received)}
        self.received_dtypes = [_dtype(r["dtype"]) for r in self.received]  # as traced (mixed precision casts)
        self.outputs = spec["outputs"]
        # outputs nothing in this stage reads again: their memory may go once sent (see _deallocate)
        self.returned_only = spec.get("outputs_returned_only", [False] * len(self.outputs))
        self.sym_names = [item["name"] for item in spec.get("sym_inputs", [])]
        self.grad_slots = [slot for slot, r in enumerate(self.received) if r["requires_grad"]]
        self.local_inputs = []  # (slot, producer runner, output position): values handed over in memory
        self.local_grad_targets = []  # per grad slot: (producer runner, output position) or None
        self.deallocatable = None  # output positions freed right after they are sent (decided at the first F)
        self.sends_b_per_mb = 0  # SEND_B actions per microbatch: in_grads are dropped after the last one
        self.sends_f_per_mb = 0  # SEND_F actions per microbatch: outputs may be freed after the last one
        self.is_last = is_last
        self.weight_split = WeightSplit(self.params)  # zero-bubble I/W: the graph analysis, reused across microbatches
        self.reset(0)

    @property
    def params(self) -> list:
        """The stage's trainable parameters as the module holds them now: under FSDP, the unsharded ones its
        forward computed with (the leaves of this step's autograd graph), not the shards held between steps."""
        compute = getattr(self.fn, "compute_parameters", None)
        return compute() if compute is not None else [p for p in self.fn.parameters() if p.requires_grad]

    def reset(self, num_microbatches: int) -> None:
        self.inputs = [[None] * len(self.received) for _ in range(num_microbatches)]
        self.out = [None] * num_microbatches
        self.loss = [None] * num_microbatches
        self.out_grads = [[None] * len(self.outputs) for _ in range(num_microbatches)]
        self.in_grads = [None] * num_microbatches
        self.sends_b_left = [self.sends_b_per_mb] * num_microbatches
        self.sends_f_left = [self.sends_f_per_mb] * num_microbatches
        self.recv_works = [[] for _ in range(num_microbatches)]
        self.grad_works = [[] for _ in range(num_microbatches)]
        self.grad_buffers = [[] for _ in range(num_microbatches)]  # (output position, received gradient)
        self.pooled = [[] for _ in range(num_microbatches)]  # receive buffers to give back after backward
        self.pending_weight = {}  # mb -> what W needs, kept from I (see _weight_backward)
        self.finite = [None] * num_microbatches  # mb -> [witness per floating output] (see _finite_witness)


_ENGINE = getattr(torch.autograd.Variable, "_execution_engine", None)


def _run_backward(tensors: list, grads: list, keep_graph: bool, inputs: tuple, accumulate: bool):
    """autograd's engine without the Python-side shape check, so an output whose memory was freed after
    sending (its autograd metadata still holds the true shape) can start a backward."""
    grads = [torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads)]
    return _ENGINE.run_backward(tuple(tensors), tuple(grads), keep_graph, False, inputs, True, accumulate)


def _finite_witness(tensor: torch.Tensor) -> torch.Tensor:
    """A scalar that is finite exactly when every element of ``tensor`` is: its sum in float64 (an inf or NaN
    element makes it inf or NaN; a sum of finite fp32/bf16/fp16 values cannot overflow float64). One reduction
    that allocates nothing the size of ``tensor``: 4 to 8 times cheaper on CPU than ``isfinite().all()``. A
    float64 tensor, whose sum could overflow, gets the sum of ``tensor * 0`` (0, or NaN from an inf or NaN)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.float64:
        return (tensor * 0).sum()
    return tensor.sum(dtype=torch.float64)


def _grad_accumulator(param: torch.Tensor):
    return param.view_as(param).grad_fn.next_functions[0][0]


def _preorder(tensors: list) -> list:
    """The nodes of the autograd graph of ``tensors``, each once, parents first, in an order fixed by the graph's
    shape: the same stage code on another microbatch lists its nodes in the same positions. (A fifth of
    :func:`_postorder`'s cost: it runs for every microbatch of a zero-bubble I.)"""
    order, seen = [], set()
    stack = [t.grad_fn for t in reversed(tensors) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return order


def _postorder(tensors: list) -> list:
    """The nodes of the autograd graph of ``tensors``, each once, children before parents."""
    postorder, seen = [], set()
    stack = [(t.grad_fn, False) for t in tensors if t.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            postorder.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in seen)
    return postorder


def _weight_entries(tensors: list, inputs: list, params: list) -> tuple:
    """Where dW branches off dI in the autograd graph of ``tensors``: ([(entry node, [params])], [params]).

    The nodes that lead to an input run during I; an *entry* is such a node with a child that leads only to
    parameters (a matmul's weight edge, a transpose of the weight, a layer norm's affine edge). Capturing
    each entry's incoming gradient during I lets W run just the weight side of the entry. A parameter
    reached from exactly one entry is computed that way; any other (a weight used in two places, where one
    route's backward also reaches the other, or one reachable from no entry) is returned second, for a
    backward from the outputs instead, so nothing is counted twice or missed.
    """
    accumulators = {_grad_accumulator(p): p for p in params}
    input_nodes = {_grad_accumulator(t) for t in inputs}
    postorder = _postorder(tensors)
    seen = set(postorder)
    leads_to_input, param_side = {}, {}  # node -> bool; node (not leading to inputs) -> params below it
    for node in postorder:
        children = [child for child, _ in node.next_functions if child is not None]
        leads_to_input[node] = node in input_nodes or any(leads_to_input.get(c, c in input_nodes) for c in children)
        if not leads_to_input[node]:
            below = {accumulators[node]} if node in accumulators else set()
            for child in children:
                if child in accumulators:
                    below.add(accumulators[child])
                elif not leads_to_input.get(child, False):
                    below |= param_side.get(child, set())
            param_side[node] = below
    entries, reached_from = [], {}
    for node in postorder:
        if not leads_to_input[node]:
            continue
        found = set()
        for child, _ in node.next_functions:
            if child is None or leads_to_input.get(child, child in input_nodes):
                continue
            found |= {accumulators[child]} if child in accumulators else param_side.get(child, set())
        if found:
            entries.append((node, found))
            for param in found:
                reached_from[param] = reached_from.get(param, 0) + 1
    full = [p for p in params if _grad_accumulator(p) in seen and reached_from.get(p, 0) != 1]
    entries = [(node, [p for p in params if p in found and reached_from[p] == 1]) for node, found in entries]
    return [(node, found) for node, found in entries if found], full


def _matmul_recipe(node, params: list):
    """How W can take a matmul entry's weight gradients straight from the node's saved input, without a call
    into autograd's engine: ``(saved input attribute, ((param, kind), ...))`` or None. ``node`` must be an
    ``AddmmBackward0`` (alpha = beta = 1) or ``MmBackward0`` whose weight-side edges end in ``params`` (and
    nothing else): the weight as ``mat2`` through a transpose (``kind`` "t": dW = g.t() @ mat1, a linear layer),
    as ``mat2`` itself ("n": dW = mat1.t() @ g) and addmm's bias ("bias": g summed to the bias's shape).

    An engine call from an entry walks every node below it (dependencies, then which nodes to run) before it runs
    the one it needs: on a small stage that walk costs as much as the matmul. The recipe replaces it with the
    kernels the engine itself runs; :class:`WeightSplit` checks that bit for bit once per graph shape before it
    trusts the recipe. Parameters with tensor hooks keep the engine (it runs their hooks)."""
    name = node.name()
    if name == "AddmmBackward0" and node._saved_alpha == 1 and node._saved_beta == 1:
        saved, bias_edge, mat2_edge = "_saved_mat1", node.next_functions[0], node.next_functions[2]
    elif name == "MmBackward0":
        saved, bias_edge, mat2_edge = "_saved_self", None, node.next_functions[1]
    else:
        return None
    owner = {_grad_accumulator(p): p for p in params}
    recipe = []
    child = mat2_edge[0]
    if child in owner:
        recipe.append((owner[child], "n"))
    elif child is not None and child.name() == "TBackward0" and child.next_functions[0][0] in owner:
        recipe.append((owner[child.next_functions[0][0]], "t"))
    if bias_edge is not None and bias_edge[0] in owner:
        recipe.append((owner[bias_edge[0]], "bias"))
    covered = [p for p, _kind in recipe]
    if len(covered) != len(params) or any(all(p is not q for q in covered) for p in params):
        return None
    if any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in covered):
        return None
    return saved, tuple(recipe)


def _recipe_grad(param, kind: str, grad: torch.Tensor, mat1: torch.Tensor) -> torch.Tensor:
    """One weight gradient of a matmul recipe (see :func:`_matmul_recipe`) from the entry's output gradient."""
    return grad.t().mm(mat1) if kind == "t" else mat1.t().mm(grad) if kind == "n" else grad.sum_to_size(param.shape)


def _recipe_grads(node, recipe, grad: torch.Tensor) -> list:
    """The weight gradients of a matmul entry from its captured output gradient (see :func:`_matmul_recipe`).
    Call under ``torch.no_grad()``."""
    saved, items = recipe
    mat1 = getattr(node, saved)
    return [_recipe_grad(param, kind, grad, mat1) for param, kind in items]


def _recipe_accumulate(node, recipe, grad: torch.Tensor, fused: bool = True) -> None:
    """A checked matmul recipe's weight gradients accumulated into ``.grad`` (under ``torch.no_grad()``). Where the
    weight already holds a gradient ("t", "n"), one ``addmm_`` adds the product in the matmul kernel itself,
    without a temporary the size of the weight and a second pass over it: the same products, added to the
    running sum inside the kernel (rounding may differ from a separate add in the last bit)."""
    saved, items = recipe
    mat1 = getattr(node, saved)
    for param, kind in items:
        held = param.grad
        if kind == "bias" or held is None or held.dtype != grad.dtype or held.is_sparse or not fused:
            _accumulate(param, _recipe_grad(param, kind, grad, mat1))
        elif kind == "t":
            held.addmm_(grad.t(), mat1)
        else:
            held.addmm_(mat1.t(), grad)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does with a dense gradient: take it if ``.grad`` is empty, else add."""
    if param.grad is None:
        param.grad = grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)
    else:
        param.grad.add_(grad)


def _accumulate_all(params, grads) -> None:
    """:func:`_accumulate` for many: where every parameter already has a ``.grad`` of its gradient's dtype and
    device, one ``_foreach_add_`` (the same elementwise adds, one dispatch instead of one per parameter)."""
    pairs = [(param, grad) for param, grad in zip(params, grads) if grad is not None]
    if pairs and all(param.grad is not None and param.grad.dtype == grad.dtype and param.grad.device == grad.device
                     and not param.grad.is_sparse and not grad.is_sparse for param, grad in pairs):
        torch._foreach_add_([param.grad for param, _grad in pairs], [grad for _param, grad in pairs])
        return
    for param, grad in pairs:
        _accumulate(param, grad)


class WeightSplit:
    """One stage's backward split in two for zero-bubble schedules: :meth:`input_backward` (I) computes the
    gradients of the received activations and captures, at each entry node (see :func:`_weight_entries`), the
    gradient flowing into it; :meth:`weight_backward` (W) later runs only the weight side of each entry from
    that gradient, so I + W does the work of one full backward plus one small autograd call per entry (or, for a
    matmul entry whose recipe was checked, its weight kernels alone: see :func:`_matmul_recipe`, adding into a
    weight's held gradient inside the matmul: see :func:`_recipe_accumulate`).

    The graph analysis is done once and reused: every microbatch of a stage builds an autograd graph of the same
    shape, so the entries sit at the same positions of :func:`_preorder`; a graph of another shape (another
    code path) is analysed afresh. Entries whose parameters are all vectors (a norm's affine weights: cheap to
    compute, one autograd call each to defer) are computed during I instead.
    """

    eager_vectors = True  # vector-only entries (norm weights) run whole during I
    matmul_recipes = True  # matmul entries run their weight kernels directly once checked (see _matmul_recipe)
    fused_accumulate = True  # a checked recipe adds into a held .grad inside its matmul (see _recipe_accumulate)

    def __init__(self, params: list):
        self.params = params
        self._signature = None  # node types in preorder of the graph the analysis below belongs to
        self._checks = ()  # (position, tensor index): leaves that must sit at those positions (params, inputs)
        self._entries = ()  # (position, number of grad outputs, params) of the entries W runs
        self._eager = ()  # (position, number of grad outputs, params) of the entries I runs whole
        self._full = []  # params that take a backward from the outputs in W
        self._recipes = ()  # per deferred entry: its matmul recipe or None (see _matmul_recipe)
        self._verdicts = []  # per deferred entry: None until checked, then whether its recipe matched the engine
        self._positions = ()  # each deferred entry's position in the preorder
        self._one_output = True  # every deferred entry has one gradient output
        self._eager_params = ()  # the parameters of the entries I runs whole

    def use(self, params: list) -> None:
        """The parameters the next backward reaches (FSDP swaps its unsharded ones in for the forward); the
        analysis is redone when they are other objects than the last plan's."""
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            self.params = params
            self._signature = None

    def _plan(self, tensors: list, order: list, inputs: list) -> None:
        entries, self._full = _weight_entries(tensors, inputs, self.params)
        position = {node: i for i, node in enumerate(order)}
        leaves = list(self.params) + list(inputs)
        where = {id(_grad_accumulator(t)): k for k, t in enumerate(leaves)}
        self._checks = tuple((i, where[id(node)]) for i, node in enumerate(order) if id(node) in where)
        deferred, eager = [], []
        for node, params in entries:
            item = (position[node], len(node._input_metadata), tuple(params))
            (eager if self.eager_vectors and all(p.dim() <= 1 for p in params) else deferred).append(item)
        self._entries, self._eager = tuple(deferred), tuple(eager)
        self._recipes = tuple(_matmul_recipe(order[position], params) if outputs == 1 and self.matmul_recipes else None
                              for position, outputs, params in self._entries)
        self._verdicts = [None] * len(self._entries)  # a fresh list: pending W of the old shape keep theirs
        self._positions = tuple(position for position, _outputs, _params in self._entries)
        self._one_output = all(outputs == 1 for _position, outputs, _params in self._entries)
        self._eager_params = tuple(param for _position, _outputs, params in self._eager for param in params)
        self._signature = tuple(map(type, order))

    def _matches(self, order: list, inputs: list) -> bool:
        if self._signature is None or len(order) != len(self._signature):
            return False
        if tuple(map(type, order)) != self._signature:
            return False
        leaves = self.params
        count = len(leaves)
        for position, k in self._checks:
            expected = leaves[k] if k < count else inputs[k - count]
            if getattr(order[position], "variable", None) is not expected:
                return False
        return True

    def input_backward(self, tensors: list, grads: list, inputs: list) -> tuple:
        """I: (gradients of ``inputs``, what :meth:`weight_backward` needs, whether it needs the outputs).
        Gradients of parameters computed here (vector-only entries) are accumulated into ``.grad``."""
        order = _preorder(tensors)
        if not self._matches(order, inputs):
            self._plan(tensors, order, inputs)
        nodes = [order[position] for position in self._positions]
        if self._one_output:  # every entry has one gradient output (matmuls): one edge each
            edges = [GradientEdge(node, 0) for node in nodes]
        else:
            edges = [GradientEdge(node, i) for node, (_p, outputs, _q) in zip(nodes, self._entries)
                     for i in range(outputs)]
        eager = self._eager_params
        # one engine call: input gradients, the gradients flowing into each deferred entry, and the vector
        # parameters' gradients
        found = _run_backward(tensors, grads, True, (*inputs, *eager, *edges), False)
        count = len(inputs)
        if eager:
            _accumulate_all(eager, found[count:count + len(eager)])
        captured = found[count + len(eager):]
        # what W needs: this plan's entries (a later graph shape gets a plan of its own), the nodes, the edges and
        # the gradients captured at them; an entry whose gradient is missing did not run for dI, so its weights
        # take a backward from the outputs
        missing = any(grad is None for grad in captured)
        pending = (self._entries, self._recipes, self._verdicts, self._full, nodes, edges, captured, missing)
        return list(found[:count]), pending, bool(self._full) or missing

    @staticmethod
    def from_outputs(params) -> tuple:
        """What :meth:`weight_backward` needs to take every one of ``params`` by a backward from the outputs."""
        return (), (), [], tuple(params), [], [], [], False

    @staticmethod
    def weight_backward(pending, tensors=None, grads=None) -> None:
        """W: each entry's weight side from its captured gradient, accumulated into ``.grad``; the parameters
        listed as ``full`` by a backward from ``tensors`` (the outputs, kept for it). A matmul entry with a recipe
        runs its weight kernels directly once the recipe has matched the engine bit for bit (checked on the
        first W of each graph shape: the engine's gradients are the ones accumulated then)."""
        entries, recipes, verdicts, full, nodes, edges, captured, missing = pending
        full = list(full)
        offset = 0
        with torch.no_grad():
            for k, (_position, outputs, params) in enumerate(entries):
                node, grad_outputs = nodes[k], captured[offset:offset + outputs]
                entry_edges = edges[offset:offset + outputs]
                offset += outputs
                if missing:
                    used = [(e, g) for e, g in zip(entry_edges, grad_outputs) if g is not None]
                    if not used:  # the entry did not run for dI after all: its weights from the outputs
                        full += params
                        continue
                    entry_edges, grad_outputs = tuple(e for e, _g in used), tuple(g for _e, g in used)
                recipe = recipes[k] if verdicts[k] is not False and outputs == 1 else None
                if recipe is None:
                    _ENGINE.run_backward(tuple(entry_edges), tuple(grad_outputs), True, False, params, True, True)
                elif verdicts[k]:
                    _recipe_accumulate(node, recipe, grad_outputs[0], WeightSplit.fused_accumulate)
                else:  # first use of this shape: the engine's result, and whether the recipe matches it
                    order = tuple(param for param, _kind in recipe[1])
                    ours = _recipe_grads(node, recipe, grad_outputs[0])
                    found = _ENGINE.run_backward(tuple(entry_edges), tuple(grad_outputs), True, False, order, True,
                                                 False)
                    verdicts[k] = all(a is not None and a.dtype == b.dtype and a.shape == b.shape and
                                      torch.equal(a, b) for a, b in zip(found, ours))
                    for param, grad in zip(order, found):
                        _accumulate(param, grad)
        if full and tensors:
            _run_backward(tensors, grads, False, tuple(full), True)


class RankExecutor:
    """This rank's action list compiled into closures; :meth:`run_step` runs it once.

    ``stage_modules``: stage index -> module called as ``module(*root_inputs, *received, *sizes)``.
    ``releases``: {action position: [send positions safe to wait on after it]}: the rank script's ``RELEASES``,
    computed at plan time by the replay engine (``replay.ReplayResult.releases``); None or ``{}``: every send
    is waited on at the end of the step (always safe). This rank's list is all the executor reads of the plan. ``wire_dtype``: floating boundary tensors are sent and
    received in this dtype (``--mixed-precision autocast``) instead of the traced one. ``input_dtype``: the model's
    floating inputs are cast to it (``--mixed-precision params``: the stage code was traced so). ``loss_scale``: the loss is multiplied
    by it before backward (fp16); the returned loss is not. ``check_finite``: record, per stage and
    microbatch, whether its floating outputs were finite (read by :meth:`nonfinite_outputs`).
    ``split_weight_backward``: False runs W as a backward from the outputs (for compiled stages, whose
    autograd graph is one node). ``action_hook(text, run)``: if set, called for every action instead of
    ``run()`` (measurement), e.g. to time it.
    """

    def __init__(self, manifest: dict, rank: int, stage_modules: dict, actions: list, device: torch.device,
                 loss_fn, timeout_s: float, out_spec, training: bool, shapes=None, releases=None,
                 wire_dtype=None, loss_scale=None, check_finite=False, split_weight_backward=True,
                 mark_dynamic=False, input_dtype=None):
        import torch.utils._pytree as pytree

        self.pytree = pytree
        self.rank = rank
        self.device = device
        self.loss_fn = loss_fn
        self.training = training
        self.timeout = timedelta(seconds=timeout_s)
        self.out_spec = out_spec
        self.stage_to_rank = manifest["plan"]["stage_to_rank"]
        self.num_stages = len(self.stage_to_rank)
        self.last_stage = self.num_stages - 1
        self.use_batch_p2p = device.type == "cuda"
        self.output_leaves = manifest["output_leaves"]
        self.deallocate_outputs = training and _ENGINE is not None
        self.free_buffers: dict = {}  # (shape, dtype) -> [tensor]: receive buffers reused across microbatches
        self.send_works: dict = {}  # action position -> works of that send, until released
        self.wire_dtype = wire_dtype
        self.input_dtype = input_dtype
        self.loss_scale = loss_scale
        self.check_finite = check_finite
        self.split_weight_backward = split_weight_backward
        self.action_hook = None
        # data parallel (mesh.py): pipeline rank -> global rank of this replica's peer, the pp group for P2P,
        # and a callback before each backward (FSDP's per-step gradient sync)
        self.global_ranks = None
        self.pp_group = None
        self.before_backward = None
        self.transport = None  # shm_p2p.SharedMemoryP2P for CPU peers on this host (set by the caller), else gloo
        self.stages = {}
        for spec in manifest["stages"]:
            if self.stage_to_rank[spec["index"]] != rank:
                continue
            self.stages[spec["index"]] = StageActivations(spec, stage_modules[spec["index"]],
                                                          spec["index"] == self.last_stage)
        self.dynamic_dims = {}  # stage -> [(argument position, [dims])] marked dynamic for torch.compile
        if mark_dynamic:
            self._find_dynamic_dims(manifest)
        # which outputs of a stage go to which consumer, in the order they travel
        self.edge_values = {}  # (producer, consumer) -> [(output position, name, meta)]
        for spec in manifest["stages"]:
            for position, name in enumerate(spec["outputs"]):
                value = manifest["values"].get(name)
                if value is None or value["producer"] != spec["index"]:
                    continue
                for consumer in value["consumers"]:
                    self.edge_values.setdefault((spec["index"], consumer), []).append((position, name, value))
        for (producer, consumer), values in self.edge_values.items():
            if len(values) > MAX_VALUES_PER_EDGE:
                raise ValueError(f"stage {producer} sends {len(values)} tensors to stage {consumer}; message tags "
                                 f"allow at most {MAX_VALUES_PER_EDGE} per microbatch: split at another point")
        self.locally_consumed = set()  # (stage, output position) read by another stage on this rank
        for runner in self.stages.values():
            for slot, item in enumerate(runner.received):
                producer = self.stages.get(item["producer"])
                if producer is not None:
                    position = producer.outputs.index(item["name"])
                    runner.local_inputs.append((slot, producer, position))
                    self.locally_consumed.add((producer.index, position))
            for slot in runner.grad_slots:
                producer = self.stages.get(runner.received[slot]["producer"])
                runner.local_grad_targets.append(
                    (producer, producer.outputs.index(runner.received[slot]["name"])) if producer else None)
        self.shapes = shapes if shapes is not None else _shapes_from_manifest(manifest)
        self.actions = list(actions)
        self.program = self._compile(actions, releases)

    def _find_dynamic_dims(self, manifest: dict) -> None:
        roots = {root["leaf_index"]: root for root in manifest["root_inputs"]}
        for runner in self.stages.values():
            marks = []
            shapes = [roots[i].get("shape") for i in runner.root_leaf_indices] + [r["shape"] for r in runner.received]
            for position, shape in enumerate(shapes):
                dims = [d for d, size in enumerate(shape or []) if not isinstance(size, int)]
                if dims:
                    marks.append((position, dims))
            self.dynamic_dims[runner.index] = marks

    # -- compile ---------------------------------------------------------------------------------------
    def _compile(self, actions: list, releases=None) -> list:
        """Closures in action order; each carries the positions of earlier sends it may release after it."""
        release_at = {int(k): list(v) for k, v in (releases or {}).items()}
        program, batch = [], []
        last_use = {}  # stage -> the position of its last compute action: its compute weights may go after it
        for position, text in enumerate(actions):
            stage, kind, _mb, _peer = parse_action(text)
            if kind in ("F", "B", "I", "W"):
                last_use[stage] = position

        def emit(fn, covered):
            label = " ".join(actions[q] for q in covered)
            program.append((fn, [p for q in covered for p in release_at.get(q, ())], label))

        for position, text in enumerate(actions):
            stage, kind, mb, peer = parse_action(text)
            if kind.startswith(("SEND", "RECV")):
                batch.append((position, self._comm_op(stage, kind, mb, peer)))
                if kind == "SEND_B" and mb == 0:
                    self.stages[stage].sends_b_per_mb += 1
                if kind == "SEND_F" and mb == 0:
                    self.stages[stage].sends_f_per_mb += 1
                continue
            if batch:
                emit(self._comm_batch(batch), [p for p, _build in batch])
                batch = []
            runner = self.stages[stage]
            last = last_use[stage] == position
            done = runner.fn.weights_used if getattr(runner.fn, "cast_weights", None) else None
            if kind == "F":
                fn = lambda r=runner, m=mb: self._forward(r, m)  # noqa: E731
                if last and done is not None:  # forward only: the step's last use of the stage's weights
                    fn = lambda r=runner, m=mb, done=done: (self._forward(r, m), done(True))  # noqa: E731
            else:
                part = _BACKWARD_PART[kind]
                fn = lambda r=runner, m=mb, part=part: self._backward(r, m, part)  # noqa: E731
                if done is not None:  # the gradients on the compute copies go into the masters' (fp32)
                    fn = lambda r=runner, m=mb, part=part, last=last, done=done: (  # noqa: E731
                        self._backward(r, m, part), done(last))
            emit(fn, [position])
        if batch:
            emit(self._comm_batch(batch), [p for p, _build in batch])
        return program

    def _tag(self, direction: str, producer: int, consumer: int, index: int) -> int:
        edge = (_DIRECTION_TAG[direction] * self.num_stages + producer) * self.num_stages + consumer
        return edge * MAX_VALUES_PER_EDGE + index

    def _give_back(self, buffers: list) -> None:
        for buffer in buffers:
            self.free_buffers.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)

    def _acquire(self, shape, dtype) -> torch.Tensor:
        free = self.free_buffers.get((shape, dtype))
        if free:
            return free.pop()
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _on_wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a boundary tensor travels in: the compute dtype for floating tensors under mixed precision."""
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype

    def _comm_op(self, stage: int, kind: str, mb: int, peer: int):
        """A function returning [(is_send, tensor, peer_rank, tag, waitlist, awaited)] for one comm action;
        ``awaited`` says in words what a wait on it waits for (the stall message)."""
        if peer is None:
            raise ValueError(f"action {stage}{kind}{mb} has no peer stage; the plan must be lowered by tracepp")
        peer_rank = self.stage_to_rank[peer]
        runner = self.stages[stage]
        if kind == "SEND_F":
            items = [(pos, self._tag("F", stage, peer, i)) for i, (pos, _n, _v) in
                     enumerate(self.edge_values[(stage, peer)])]

            def ops():
                out = runner.out[mb]
                awaited = f"rank {peer_rank} (stage {peer}) to receive the activation of microbatch {mb}"
                result = [(True, self._wire(out[pos].detach()), peer_rank, tag, None, awaited) for pos, tag in items]
                runner.sends_f_left[mb] -= 1
                if runner.sends_f_left[mb] == 0 and runner.deallocatable:
                    self._deallocate(runner, mb)  # every consumer's send holds the data it needs
                return result
        elif kind == "RECV_F":
            items = [(runner.received_index[(peer, name)], name, self._on_wire(_dtype(value["dtype"])),
                      self._tag("F", peer, stage, i))
                     for i, (_pos, name, value) in enumerate(self.edge_values[(peer, stage)])]

            def ops():
                result = []
                shapes = self.mb_shapes[mb]
                for slot, name, dtype, tag in items:
                    buffer = self._acquire(shapes[activation_key(name, peer)], dtype)
                    runner.inputs[mb][slot] = buffer
                    runner.pooled[mb].append(buffer)
                    result.append((False, buffer, peer_rank, tag, runner.recv_works[mb],
                                   f"the activation of microbatch {mb} from rank {peer_rank} (stage {peer})"))
                return result
        elif kind == "SEND_B":
            items = [(runner.received_index[(peer, name)], self._tag("B", peer, stage, i)) for i, (_p, name, v) in
                     enumerate(self.edge_values[(peer, stage)]) if v["requires_grad"]]

            def ops():
                grads = runner.in_grads[mb]
                awaited = f"rank {peer_rank} (stage {peer}) to receive the gradient of microbatch {mb}"
                result = [(True, self._wire(grads[slot]), peer_rank, tag, None, awaited) for slot, tag in items]
                runner.sends_b_left[mb] -= 1
                if runner.sends_b_left[mb] == 0:
                    runner.in_grads[mb] = None  # the sends hold what they need
                return result
        else:  # RECV_B
            items = [(pos, name, self._on_wire(_dtype(v["dtype"])), self._tag("B", stage, peer, i)) for i, (pos, name, v) in
                     enumerate(self.edge_values[(stage, peer)]) if v["requires_grad"]]

            def ops():
                result = []
                shapes = self.mb_shapes[mb]
                for pos, name, dtype, tag in items:
                    buffer = self._acquire(shapes[gradient_key(name, peer)], dtype)
                    runner.grad_buffers[mb].append((pos, buffer))
                    runner.pooled[mb].append(buffer)
                    result.append((False, buffer, peer_rank, tag, runner.grad_works[mb],
                                   f"the gradient of microbatch {mb} from rank {peer_rank} (stage {peer})"))
                return result
        return ops

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as it travels: in the wire dtype (mixed precision), contiguous. No torch call where it already
        is (each one costs microseconds right after a compute, when the dispatcher is cold in the caches)."""
        if self.wire_dtype is not None:
            tensor = tensor.to(self._on_wire(tensor.dtype))
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _comm_batch(self, op_builders: list):
        def run():
            ops, owners = [], []
            for position, build in op_builders:
                built = build()
                ops += built
                owners += [position] * len(built)
            if not ops:
                return
            ranks, group = self.global_ranks, self.pp_group
            if ranks is not None:  # pipeline ranks -> this replica's global ranks
                ops = [(send, tensor, ranks[peer], tag, waitlist, awaited)
                       for send, tensor, peer, tag, waitlist, awaited in ops]
            shm = self.transport
            if self.use_batch_p2p:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, peer,
                                                           group=group, tag=tag)
                                                for send, tensor, peer, tag, _, _ in ops])
            elif shm is not None:  # shared-memory rings to ranks on this host (shm_p2p), gloo to the others
                works = [(shm.isend if send else shm.irecv)(tensor, peer, tag) if shm.carries(peer, send) else
                         (dist.isend if send else dist.irecv)(tensor, peer, group=group, tag=tag)
                         for send, tensor, peer, tag, _, _ in ops]
            else:
                works = [(dist.isend if send else dist.irecv)(tensor, peer, group=group, tag=tag)
                         for send, tensor, peer, tag, _, _ in ops]
            for work, position, (send, _tensor, _peer, _tag, waitlist, awaited) in zip(works, owners, ops):
                if send:
                    self.send_works.setdefault(position, []).append((work, awaited))
                elif waitlist is not None:
                    waitlist.append((work, awaited))
        return run

    def _release_sends(self, positions: list) -> None:
        """Wait on sends whose receive the peer has provably posted (it has since sent us something it could
        only send after posting it): the wait returns at once, and the sent tensor's memory can go."""
        for position in positions:
            self._wait(self.send_works.pop(position, []))

    # -- memory ----------------------------------------------------------------------------------------
    def _choose_deallocatable(self, runner: StageActivations, out) -> None:
        """Outputs whose values autograd will never read again: returned only (no later op in the stage
        reads them), not read by a stage on this rank, not views, and made by an op that does not save its
        own result (an add does; a tanh does not). Sending keeps a reference to the data until the send
        completes; after that the memory goes back, so in-flight activation memory follows the schedule."""
        chosen = []
        for pos, tensor in enumerate(out[:len(runner.outputs)]):
            if not (isinstance(tensor, torch.Tensor) and runner.returned_only[pos] and tensor.requires_grad):
                continue
            if (runner.index, pos) in self.locally_consumed or tensor._base is not None:
                continue
            grad_fn = tensor.grad_fn
            if grad_fn is None or hasattr(grad_fn, "_saved_result"):
                continue
            chosen.append(pos)
        runner.deallocatable = chosen

    def _deallocate(self, runner: StageActivations, mb: int) -> None:
        out = runner.out[mb]
        for pos in runner.deallocatable:
            tensor = out[pos]
            tensor.data = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)

    # -- compute ---------------------------------------------------------------------------------------
    def _wait(self, works: list) -> None:
        """Wait on ``[(work, awaited)]``; a timeout names what was awaited (the failure channel tells the rest)."""
        for work, awaited in works:
            try:
                completed = work.wait(self.timeout)
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    raise
                completed = False
            if completed is False:
                raise PipelineError(stall_message(self.rank, self.timeout.total_seconds(), awaited))
        works.clear()

    def _forward(self, runner: StageActivations, mb: int) -> None:
        if runner.recv_works[mb]:
            self._wait(runner.recv_works[mb])
        inputs = runner.inputs[mb]
        for slot, producer, pos in runner.local_inputs:
            inputs[slot] = producer.out[mb][pos].detach()
        if self.training:
            for slot in runner.grad_slots:  # a fresh leaf over the (pooled) buffer: autograd state stays per use
                inputs[slot] = inputs[slot].detach().requires_grad_(True)
        leaves = self.mb_leaves[mb]
        received = inputs
        if self.wire_dtype is not None:  # the stage code sees the traced dtypes; autograd casts gradients back
            received = [value.to(dtype) if isinstance(value, torch.Tensor) else value
                        for value, dtype in zip(inputs, runner.received_dtypes)]
        args = [leaves[i] for i in runner.root_leaf_indices] + received
        for position, dims in self.dynamic_dims.get(runner.index, ()):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[position], dim)
        if runner.sym_names:
            shapes = self.mb_shapes[mb]
            args += [shapes[name] for name in runner.sym_names]
        if torch.is_grad_enabled() == self.training:
            out = runner.fn(*args)
        else:
            with torch.set_grad_enabled(self.training):
                out = runner.fn(*args)
        runner.out[mb] = out
        if self.check_finite:  # one reduction per output, read only once something went non-finite
            runner.finite[mb] = [_finite_witness(t) for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if self.deallocate_outputs and not runner.is_last and runner.deallocatable is None:
            self._choose_deallocatable(runner, out)
        if runner.is_last:
            leaves_out = [out[i] if kind == "value" else const for i, (kind, const) in enumerate(self.output_leaves)]
            if self.wire_dtype is not None or self.input_dtype is not None:  # mixed precision: the loss in fp32
                leaves_out = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                              for t in leaves_out]
            output = self.pytree.tree_unflatten(leaves_out, self.out_spec)
            if self.loss_fn is not None and self.targets[mb] is not None:
                with torch.set_grad_enabled(self.training):
                    loss = self.loss_fn(output, self.targets[mb]).float()
                    # a microbatch whose every token is ignored (its weight 0: split.token_mean) has a mean of 0/0
                    loss = loss * self.scales[mb] if self.scales[mb] else loss.nan_to_num(0.0) * 0.0
                runner.loss[mb] = loss if self.loss_scale is None else loss * self.loss_scale
                self.step_loss = self.step_loss + loss.detach()
                self.has_loss = True
            else:
                self.outputs[mb] = output

    def _backward(self, runner: StageActivations, mb: int, part: str) -> None:
        if part == "weight":  # the second half of a split backward: weight gradients only
            pending = runner.pending_weight.pop(mb)
            if pending is not None:  # None: its I ran the whole backward (see below)
                self._weight_backward(runner, *pending)
                self._release(runner, mb)
            return
        if part == "input" and getattr(runner.fn, "recompute", False) == "selective":
            # selective checkpointing recomputes a region once and lets autograd run backward through it once
            # (torch's SAC): this stage's I runs its whole backward and its W has nothing left to do
            self._backward(runner, mb, "full")
            runner.pending_weight[mb] = None
            return
        if self.before_backward is not None:
            self.before_backward(runner.index, mb)
        if runner.is_last:
            tensors, grads = [runner.loss[mb]], [None]
        else:
            tensors, grads = self._output_grads(runner, mb)
        wanted = [runner.inputs[mb][slot] for slot in runner.grad_slots]
        if part == "full":
            if tensors:
                _run_backward(tensors, grads, False, (), True)
            runner.in_grads[mb] = self._input_grads(runner, mb, [t.grad for t in wanted])
            self._release(runner, mb)
        else:  # "input": gradients for received activations now, weights later (zero-bubble schedules)
            params = runner.params
            if tensors and wanted and params and self.split_weight_backward:
                runner.weight_split.use(params)
                found, pending, keep = runner.weight_split.input_backward(tensors, grads, wanted)
            else:  # nothing to split off (or a compiled stage, one autograd node): W is a backward from the outputs
                found = (_run_backward(tensors, grads, True, tuple(wanted), False)
                         if tensors and wanted else [None] * len(wanted))
                pending, keep = WeightSplit.from_outputs(params), True
            runner.in_grads[mb] = self._input_grads(runner, mb, list(found))
            if keep:  # some weights need a backward from the outputs: keep them
                runner.pending_weight[mb] = (pending, tensors, grads)
            else:  # W needs only the entry nodes and their captured gradients: let the rest of the graph go
                runner.pending_weight[mb] = (pending, None, None)
                runner.out[mb], runner.loss[mb] = None, None

    @staticmethod
    def _weight_backward(runner: StageActivations, pending, tensors, grads) -> None:
        """dW (see :class:`WeightSplit`): each entry's weight side from the gradient captured during I, so I + W
        costs about what one full backward does; weights listed as ``full`` take a backward from the outputs."""
        WeightSplit.weight_backward(pending, tensors, grads)

    def _output_grads(self, runner: StageActivations, mb: int):
        """Outputs that carry a gradient, with the sum of the gradients every consumer sent back."""
        if runner.grad_works[mb]:
            self._wait(runner.grad_works[mb])
        sums = runner.out_grads[mb]
        for pos, buffer in runner.grad_buffers[mb]:
            sums[pos] = buffer if sums[pos] is None else sums[pos] + buffer
        runner.grad_buffers[mb] = []
        tensors, grads = [], []
        out = runner.out[mb]
        for pos, grad in enumerate(sums):
            if grad is not None and out[pos].requires_grad:
                tensors.append(out[pos])
                grads.append(grad.to(out[pos].dtype))
        return tensors, grads

    def _input_grads(self, runner: StageActivations, mb: int, found: list) -> list:
        """Gradients for this stage's received inputs, indexed by received slot; local producers get theirs now."""
        grads = [None] * len(runner.received)
        for slot, grad, target in zip(runner.grad_slots, found, runner.local_grad_targets):
            if grad is None:
                grad = torch.zeros_like(runner.inputs[mb][slot])
            grads[slot] = grad
            if target is not None:  # same rank: hand the gradient over in memory
                producer, pos = target
                sums = producer.out_grads[mb]
                sums[pos] = grad if sums[pos] is None else sums[pos] + grad
        return grads

    def _release(self, runner: StageActivations, mb: int) -> None:
        """Backward of ``mb`` is done on this stage: drop its activations, give its receive buffers back."""
        runner.out[mb] = None
        runner.loss[mb] = None
        runner.out_grads[mb] = [None] * len(runner.outputs)
        runner.inputs[mb] = [None] * len(runner.received)
        self._give_back(runner.pooled[mb])
        runner.pooled[mb] = []

    # -- a step ----------------------------------------------------------------------------------------
    def run_step(self, mb_leaves: list, targets: list, scales: list, symbols: list):
        """Run every action once. On the last stage's rank returns the full-batch loss (a tensor) when targets
        and a loss function are given, else the list of per-microbatch outputs; None on other ranks."""
        num_microbatches = len(mb_leaves)
        if self.input_dtype is not None:  # the model's floating inputs, as the stage code was traced
            from .precision import cast_floating

            mb_leaves = [[cast_floating(leaf, self.input_dtype) for leaf in leaves] for leaves in mb_leaves]
        self.mb_leaves, self.targets, self.scales = mb_leaves, targets, scales
        self.mb_shapes = self._step_shapes(symbols)
        self.step_loss = torch.zeros((), device=self.device)
        self.has_loss = False
        self.outputs = [None] * num_microbatches
        for runner in self.stages.values():
            if not self.training:  # forward-only: outputs may alias receive buffers until the step ends
                for buffers in runner.pooled:
                    self._give_back(buffers)
            runner.reset(num_microbatches)
        hook = self.action_hook
        for instruction, releases, label in self.program:
            if hook is None:
                instruction()
            else:
                hook(label, instruction)
            if releases:
                self._release_sends(releases)
        for works in self.send_works.values():
            self._wait(works)
        self.send_works = {}
        for runner in self.stages.values():  # every compute copy goes at the end of the step, whatever ran
            if getattr(runner.fn, "cast_weights", None):
                runner.fn.weights_used(True)
        if self.last_stage in self.stages:
            return self.step_loss if self.has_loss else self.outputs
        return None

    def _step_shapes(self, symbols: list) -> list:
        """Per microbatch, the boundary shapes and sizes for its symbol binding; microbatches with the same
        binding (all of them with static shapes) share one evaluation."""
        evaluated, shapes = {}, []
        for bound in symbols:
            key = tuple(sorted(bound.items()))
            if key not in evaluated:
                evaluated[key] = self.shapes(**bound)
            shapes.append(evaluated[key])
        return shapes

    def nonfinite_outputs(self) -> list:
        """[(stage, microbatch)] whose floating outputs held a NaN or inf in the last step (``check_finite``)."""
        found = []
        for runner in self.stages.values():
            for mb, witnesses in enumerate(runner.finite):
                if witnesses and not all(bool(torch.isfinite(w)) for w in witnesses):
                    found.append((runner.index, mb))
        return sorted(found)
