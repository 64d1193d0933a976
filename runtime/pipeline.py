"""The public step API: a :class:`Pipeline` owns this rank's stages and runs one pipelined step at a time.

Run under torchrun, one process per rank, from a script of your own::

    import sys; sys.path.insert(0, "out")          # the output folder holds tracepp_runtime
    import tracepp_runtime
    pipe = tracepp_runtime.Pipeline("out")         # this rank's stages, weights from model() or --load; the
                                                   # split's precision and checkpointing; its memory checked
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step in range(steps):
        loss = pipe.step(args, kwargs, target)     # a tensor on the last stage's rank, None elsewhere
        pipe.sync_shared_grads()                    # tied weights: sum the copies' gradients across ranks
        norm = pipe.clip_grad_norm_(1.0)            # optional: global norm, the same on every rank
        optimizer.step(); pipe.zero_grad()

Each stage is an ``nn.Module`` (``pipe.stages[stage_index]``) whose parameters carry the original model's
FQNs. ``step`` splits the batch into the planned microbatches and runs this rank's action list once
(``executor.RankExecutor``); gradients accumulate in the stages' ``.grad`` until ``zero_grad``. The training
loop of ``run.py`` (``launch``) is built on this API and nothing else.

A folder split with ``--dp N`` runs the same loop on ``R x N`` processes: the Pipeline builds the ``(dp, pp)``
DeviceMesh (``pipe.mesh``), wraps its stages over dp (``mesh.py``), takes replica ``pipe.dp_index``'s slice of
the global batch passed to ``step``, and returns the global batch's loss.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from .batching import MicrobatchSplitter
from .distributed import init_distributed
from . import cpu_binding, shm_p2p
from .executor import RankExecutor, _shapes_from_manifest, parse_action
from .failure import PipelineError
from .loading import load_manifest, load_rank_script
from .script_check import check_programs, describe_program
from . import mesh as dp_mesh
from . import context_parallel, expert_parallel, fast_ops, memory_fit, recompute, run_options, tensor_parallel
from . import precision as precision_policy
from .run_options import manifest_options
from .stages import StageModule
from .usercode import load_spec, load_user_module
from .weights import load_rank_state


def _chain(pieces: list):
    """One ``piece(fqn, tensor)`` applying each of ``pieces`` in turn (tensor- then expert-parallel), or None."""
    if not pieces:
        return None

    def piece(fqn: str, tensor):
        for cut in pieces:
            tensor = cut(fqn, tensor)
        return tensor
    return piece

PRECISIONS = dict(precision_policy.COMPUTE_DTYPES)  # precision -> the dtype it computes in (fp8: bf16 outside linears)


def _traced_loss(function):
    """``loss_fn(output, target)`` calling the traced loss of a ``--cp`` folder with the output's tensor leaves
    and the target's leaves (``STAGE_FUNCTIONS["loss"]`` of the last rank's script)."""
    import torch.utils._pytree as pytree

    def loss_fn(output, target):
        leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        out = function(*leaves, *pytree.tree_leaves(target))
        return out[0] if isinstance(out, (tuple, list)) else out
    return loss_fn

_STEP_HOOKS: list = []


def register_step_hook(hook):
    """Call ``hook(pipeline, step_index)`` before every :meth:`Pipeline.step` of every Pipeline in this process
    (step_index counts that pipeline's steps from 0). Returns a function that removes the hook. For tools
    that wrap a generated ``run.py`` they do not construct the Pipeline of (e.g. a memory profiler)."""
    _STEP_HOOKS.append(hook)
    return lambda: _STEP_HOOKS.remove(hook)


_STEP_END_HOOKS: list = []


def register_step_end_hook(hook):
    """Call ``hook(pipeline, step_index)`` at the end of every training step of ``run.py``'s loop (``launch``):
    after the optimizer step and the metrics line, before a checkpoint of that step is written. With
    :func:`register_step_hook` it brackets whole steps of a generated ``run.py`` (e.g. a memory profiler's
    window); a loop of your own knows where its steps end. Returns a function that removes the hook."""
    _STEP_END_HOOKS.append(hook)
    return lambda: _STEP_END_HOOKS.remove(hook)


def step_ended(pipeline, step_index: int) -> None:
    """Run the hooks of :func:`register_step_end_hook` (called by ``launch.train``)."""
    for hook in list(_STEP_END_HOOKS):
        hook(pipeline, step_index)


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("--precision fp16 needs a GPU (it trains with a loss scaler for CUDA's fp16); "
                         "on CPU use --precision bf16 or fp32")
    if precision == "fp8":
        problem = precision_policy.fp8_problem(device)
        if problem is not None:
            raise ValueError(problem)


class Pipeline:
    """This rank's part of a tracepp pipeline (see the module docstring for a loop).

    ``folder``: the output folder of ``tracepp split``. ``rank``: default ``$RANK``. ``device``: default
    ``cuda:$LOCAL_RANK`` where CUDA is available, else CPU. The job is the one the split planned and counted
    (``manifest["run_options"]``, as run.py runs it): ``precision`` and ``activation_checkpointing`` default to the
    split's, and one given here that differs is named once at start-up (the plan's memory figures are then not
    checked). ``precision``: ``fp32``, ``bf16``, ``fp16`` or ``fp8``, applied as the folder's ``--mixed-precision``
    says (``precision.py``): the parameters stay fp32 (the master weights) and are cast to the compute dtype once per
    step (FSDP2's ``MixedPrecisionPolicy``: gathered and computed in bf16, gradients reduced in fp32), or, for stage
    code traced in fp32, each stage's forward runs under ``torch.autocast``; the loss is computed in fp32.
    ``activation_checkpointing``: a mode of ``recompute`` (the split records one per stage); ``pipe.checkpointing``
    says which of this rank's stages recompute. ``memory_check``: ``on`` (default) compares the plan's peak with this
    device before anything runs and stops every rank when one cannot hold it, ``warn`` only says so, ``off`` skips it
    (:meth:`check_memory`); ``memory_reserve``: what the CUDA check keeps free for NCCL and fragmentation.
    ``compile``: ``torch.compile`` each stage module (dynamic dims from the manifest marked dynamic);
    ``compile_cache``: inductor's cache folder. ``all_stages``:
    every stage in this one process, no communication (for measurement and debugging); ``actions`` overrides
    the action list (``"0F0"``, ``"0B0"``, ...). ``stage_functions``, ``actions``, ``shapes`` and ``releases``
    are what a rank script passes; left out, they are read from ``rank{rank}.py`` (its ``RELEASES`` only with
    its own ``ACTIONS``). Before anything else, every rank's actions and releases are gathered and, where one
    differs from the plan ``tracepp split`` wrote, validated as a whole: it runs as edited or every rank stops
    naming the file and line (``script_check``). ``load``: a checkpoint
    (``.safetensors``, a Hugging Face folder, a ``torch.distributed.checkpoint`` folder or a torch state_dict
    file) keyed by the model's FQNs, of which this rank reads only its own tensors; without it ``init`` says how
    the model file initialises them: ``"model"`` (build ``model()``, keep this rank's tensors: equal to eager)
    or ``"per-module"`` (only this rank's modules, seeded by FQN: for models too big for one process).
    """

    def __init__(self, folder: str, *, rank=None, device=None, timeout_s: float = 120.0, precision=None,
                 activation_checkpointing=None, memory_check: str = "on", memory_reserve=None,
                 compile: bool = False, compile_cache=None, all_stages: bool = False, stage_functions=None,
                 actions=None, shapes=None, releases=None, loss_fn=None, check_finite: bool = True,
                 load=None, init: str = "model", p2p: str = "auto", shm_ring_mb: float = shm_p2p.DEFAULT_RING_MB):
        self.folder = os.path.abspath(folder)
        self.manifest = manifest = load_manifest(self.folder)
        # the job the split planned: its precision and checkpointing unless given here (run_options.chosen)
        self.run_options, self.run_differs = run_options.chosen(
            manifest, precision=precision, activation_checkpointing=activation_checkpointing)
        precision = self.run_options.precision
        self.world_size = 1 if all_stages else int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = 0 if all_stages else int(os.environ.get("RANK", "0") if rank is None else rank)
        # data parallel: self.rank is the global rank, self.pp_rank this process's place in its pipeline
        self.layout = dp_mesh.mesh_layout(manifest["plan"])
        if all_stages:
            self.layout = self.layout.replace(dp=1)
        if all_stages and self.layout.tp > 1:
            raise PipelineError(f"{self.folder} was split with --tp {self.layout.tp}: its stages run on "
                                f"{self.layout.tp} processes each; run it with torchrun, or re-split without --tp")
        if all_stages and self.layout.ep > 1:
            raise PipelineError(f"{self.folder} was split with --ep {self.layout.ep}: its experts live on "
                                f"{self.layout.ep} processes; run it with torchrun, or re-split without --ep")
        self.dp_index, self.pp_rank = dp_mesh.coordinates(self.layout, self.rank)
        self.tp_index = dp_mesh.tp_index(self.layout, self.rank)
        self.cp_index = dp_mesh.cp_index(self.layout, self.rank)
        if all_stages and self.layout.cp > 1:
            raise PipelineError(f"{self.folder} was split with --cp {self.layout.cp}: each sample's sequence is "
                                f"spread over {self.layout.cp} processes; run it with torchrun, or re-split without "
                                f"--cp")
        self.cp_mesh = None  # with --cp: its 1-D mesh (the sequence's ranks)
        self.grad_mesh = None  # what FSDP/DDP wrap over: dp, or dp x cp with context parallelism
        self.token_group = None  # the ranks whose tokens make the global batch (expert counts): dp, or dp x cp
        self.mesh = self.replicas = None  # the (dp, pp) DeviceMesh and its 1-D dp mesh, with --dp
        self.full_mesh = self.tp_mesh = None  # with --tp: the (dp, pp, tp) mesh and its 1-D tp mesh
        self.ep_mesh = self.expert_replicas = None  # with --ep: its 1-D ep mesh; the group holding the same experts
        self.ep_index = dp_mesh.ep_index(self.layout, self.dp_index, self.cp_index)
        if all_stages:
            self.device = torch.device(device) if device is not None else torch.device("cpu")
            self.backend = None
        else:
            self.device, self.backend = init_distributed(self.rank, self.world_size, timeout_s, device)
            if self.layout.cp > 1:
                self._build_cp_mesh()
            elif self.layout.dp > 1 or self.layout.tp > 1:
                self.full_mesh, replicas = dp_mesh.build_mesh(self.layout, self.device)
                if self.layout.dp > 1:
                    self.mesh, self.replicas = self.full_mesh, replicas
                if self.layout.tp > 1:
                    self.tp_mesh = self.full_mesh["tp"]
                    tensor_parallel.set_group(self.tp_mesh.get_group(), self.layout.tp, self.tp_index)
                if self.layout.ep > 1:
                    self.ep_mesh = self.full_mesh["ep"]
                    expert_parallel.set_group(self.ep_mesh.get_group(), self.layout.ep, self.ep_index)
                    if self.layout.dp > self.layout.ep:
                        self.expert_replicas = self.full_mesh["edp"].get_group()
        try:
            self.precision, self.mixed_precision = precision_policy.resolve(manifest_options(manifest), precision)
            check_precision(self.precision, self.device)
        except ValueError as error:
            failure = PipelineError(str(error))
            failure.every_rank_agrees = True  # every rank reads the same folder and flags
            raise failure from error
        self.fp8_recipe = manifest_options(manifest).fp8_recipe
        # fp8: torchao's float8 matmul for the stage code's linears (imported here only: check_precision found it)
        self.float8 = precision_policy.Float8Linears(self.fp8_recipe) if self.precision == "fp8" else None
        self.compute_dtype = PRECISIONS[self.precision]
        autocast = self.mixed_precision == "autocast"
        # autocast: boundary tensors travel in the compute dtype; params: as traced (already the compute dtype)
        self._wire_dtype = self.compute_dtype if autocast else None
        self._input_dtype = None if autocast else self.compute_dtype
        self.training = manifest["training"]
        self.user = load_user_module(self.folder, manifest)
        if self.layout.cp > 1 and loss_fn is not None:
            raise PipelineError(f"{self.folder} was split with --cp {self.layout.cp}: the model's output holds this "
                                f"rank's positions only, and its loss is the model file's loss_fn as traced at split "
                                f"time (a mean over tokens summed over the cp ranks); pass no loss_fn, or re-split "
                                f"without --cp")
        if loss_fn is None and self.training:
            loss_fn = getattr(self.user, "loss_fn", None)
        self.loss_fn = loss_fn
        plan_manifest = manifest
        if all_stages:
            plan_manifest = copy.deepcopy(manifest)
            plan_manifest["plan"]["stage_to_rank"] = [0] * len(manifest["stages"])
            stage_functions = stage_functions or self._all_stage_functions()
            shapes = shapes or _shapes_from_manifest(manifest)
            if actions is None:
                actions = self._single_process_actions()
        else:
            if stage_functions is None:
                script = load_rank_script(self.folder, self.pp_rank)
                stage_functions, shapes = script.STAGE_FUNCTIONS, getattr(script, "boundary_shapes", None)
                if actions is None:  # the script's program: its ACTIONS and their RELEASES
                    actions = script.ACTIONS
                    releases = getattr(script, "RELEASES", None) if releases is None else releases
            self._check_program(actions, releases)
        self._plan_manifest = plan_manifest
        if self.layout.cp > 1 and self.training and "loss" in stage_functions:  # the traced, combined loss
            self.loss_fn = _traced_loss(stage_functions["loss"])
        stage_to_rank = plan_manifest["plan"]["stage_to_rank"]
        self.stage_indices = [s for s, r in enumerate(stage_to_rank) if r == self.pp_rank]
        self.is_last_rank = stage_to_rank[-1] == self.pp_rank
        for fn in stage_functions.values():  # factory ops in the stage code (torch.arange) follow the rank's device
            if "RUN_DEVICE" in getattr(fn, "__globals__", {}):
                fn.__globals__["RUN_DEVICE"] = self.device
            # its ops called without OpOverload's Python frame (fast_ops); dynamo traces torch's own objects
            (fast_ops.unbind if compile else fast_ops.bind)(fn)
            if self.float8 is not None:
                self.float8.bind(fn)
        # this rank's tensors only: from --load's checkpoint, or the model file's own initialisation
        pieces = [module.piece_for(manifest, size, index) for module, size, index, mesh in (
            (tensor_parallel, self.layout.tp, self.tp_index, self.tp_mesh),
            (expert_parallel, self.layout.ep, self.ep_index, self.ep_mesh)) if mesh is not None]
        rows = (expert_parallel.rows_for(manifest, self.layout.ep, self.ep_index)
                if self.ep_mesh is not None else None)
        state = load_rank_state(self.folder, plan_manifest, self.pp_rank, self.device, self.user, load=load, init=init,
                                piece=_chain(pieces), rows=rows)
        if self.ep_mesh is not None:  # this rank's experts, as DTensors over the ep mesh
            state = expert_parallel.distribute(state, manifest, self.ep_mesh)
        if self.tp_mesh is not None:  # this rank's shards, as DTensors over the tp mesh
            state = tensor_parallel.distribute(state, manifest, self.tp_mesh)
        self.expert_params = [tensor for fqn, tensor in state.items()
                              if expert_parallel.placement_of(manifest, fqn) is not None]
        unused = {item["fqn"] for item in manifest.get("unused_state", [])}
        self.unused_state = {fqn: tensor for fqn, tensor in state.items() if fqn in unused}  # for --save
        self.stages = {}
        for spec in manifest["stages"]:
            if spec["index"] in self.stage_indices:
                stage = StageModule(spec, stage_functions[spec["index"]], state)
                stage.autocast_dtype = self.compute_dtype if autocast else None
                stage.local_shards = self.tp_mesh is not None or self.ep_mesh is not None
                stage.sequence_shards = self.tp_mesh is not None and self.layout.sequence_parallel and not compile
                stage.context_shards = self.cp_mesh is not None and not compile
                self.stages[spec["index"]] = stage
        policy = precision_policy.mp_policy(self.precision, self.mixed_precision)
        if self.float8 is not None and self.mesh is not None and self.layout.dp_mode != "ddp":
            self.float8.gathered_weights(self.stages, manifest)  # FSDP all-gathers them in float8 (tensorwise)
        experts = {id(p) for p in self.expert_params}
        self.scalar_params = [] if self.mesh is None else [  # left out of FSDP/DDP, their gradients averaged apart
            p for p in dp_mesh.scalars(self.stages.values()) if id(p) not in experts]
        if self.mesh is not None:
            for stage in self.stages.values():
                dp_mesh.wrap_stage(stage, self.mesh, self.layout, ignored=self.expert_params + self.scalar_params,
                                   sub=self.grad_mesh, mp_policy=policy)
        if policy is not None:  # what no FSDP/DDP engine casts: every parameter without dp, routed experts and
            experts |= {id(p) for p in self.scalar_params}  # 0-dim parameters with it
            for stage in self.stages.values():
                own = [p for p in stage.parameters() if self.mesh is None or id(p) in experts]
                cast = precision_policy.CastWeights(own, self.compute_dtype)
                stage.cast_weights = cast if cast else None
        self.compiled = compile
        if compile:
            self._compile_stages(compile_cache)
        self._out_spec = load_spec(manifest, "out_spec")
        self._shapes = shapes
        self._timeout_s = timeout_s
        self._check_finite = check_finite
        self.loss_scale = None  # fp16: set by the training loop's scaler (the loss is multiplied before backward)
        self.transport = None
        if not all_stages and self.world_size > 1 and self.device.type == "cpu":
            self.transport = self._connect(actions, p2p, shm_ring_mb)
        self.executor = self._executor(actions, releases, self.training)
        mode = self.run_options.activation_checkpointing
        recompute.check_mode(mode, len(manifest["stages"]))
        self.checkpointing = recompute.apply(self, mode)  # {stage: mode} of this rank's checkpointed stages
        self._split_backward = any(parse_action(text)[1] in ("I", "W") for text in self.executor.actions)
        if self.mesh is not None and self.training:
            self._last_backward = self._last_backward_microbatch(self.executor.actions)
            self.executor.before_backward = self._before_backward
        self._eval_executor = None
        self.splitter = MicrobatchSplitter(manifest, load_spec(manifest, "in_spec"))
        self._shared = self._shared_groups() if self.world_size > 1 else []
        partial = tensor_parallel.partial_grads(manifest) if self.tp_mesh is not None and self.training else set()
        partial_params = [p for name, p in self.named_parameters() if name in partial]
        self._step_sums = tensor_parallel.StepSums(partial_params, self.tp_mesh.get_group()) if partial_params else None
        self._hooks: list = []
        self.steps_run = 0
        self.last_batch_size = None
        self._all_stages = all_stages
        if self.run_differs and not all_stages and self.rank == 0:  # named once, here (the fit check then says nothing)
            print(f"[tracepp] note: this run's options are not those tracepp split planned (manifest.json "
                  f"run_options): {'; '.join(self.run_differs)}. The plan's memory figures are for the split's, so "
                  f"they are not checked against this device; split again with these options to count them",
                  flush=True)
        if memory_check != "off":
            self.check_memory(memory_check, memory_reserve)

    # -- building -------------------------------------------------------------------------------------------
    def _build_cp_mesh(self) -> None:
        """Context parallel: the (dp, cp, pp[, tp]) mesh, FSDP/DDP over dp x cp, the cp, tp and ep groups."""
        meshes = dp_mesh.build_cp_mesh(self.layout, self.device)
        self.full_mesh = self.mesh = meshes["mesh"]
        self.replicas, self.grad_mesh, self.cp_mesh = meshes["replicas"], meshes["grads"], meshes["cp"]
        context_parallel.set_group(self.cp_mesh.get_group(), self.layout.cp, self.cp_index)
        if self.layout.dp_mode != "hsdp":
            self.token_group = self.grad_mesh.get_group()
        if meshes["tp"] is not None:
            self.tp_mesh = meshes["tp"]
            tensor_parallel.set_group(self.tp_mesh.get_group(), self.layout.tp, self.tp_index)
        if meshes["ep"] is not None:
            self.ep_mesh = meshes["ep"]
            expert_parallel.set_group(self.ep_mesh.get_group(), self.layout.ep, self.ep_index)
            if self.layout.dp * self.layout.cp > self.layout.ep:
                self.expert_replicas = meshes["edp"].get_group()

    def _check_program(self, actions, releases) -> None:
        """Every rank runs what its script says: gather every process's ACTIONS and RELEASES; where one differs
        from what ``tracepp split`` wrote, validate the whole plan or stop every rank (``script_check``)."""
        mine = describe_program(self.pp_rank, os.path.join(self.folder, f"rank{self.pp_rank}.py"), actions, releases)
        gathered = [mine]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
        note = check_programs(gathered, self.manifest)
        if note is not None and self.rank == 0:
            print(f"[tracepp] note: {note}", flush=True)

    def _all_stage_functions(self) -> dict:
        functions = {}
        for rank in sorted(set(self.manifest["plan"]["stage_to_rank"])):
            functions.update(load_rank_script(self.folder, rank).STAGE_FUNCTIONS)
        return functions

    def _single_process_actions(self) -> list:
        count = self.manifest["plan"]["num_microbatches"]
        stages = range(len(self.manifest["stages"]))
        actions = []
        for mb in range(count):
            actions += [f"{s}F{mb}" for s in stages]
            if self.manifest["training"]:
                actions += [f"{s}B{mb}" for s in reversed(stages)]
        return actions

    def _compile_stages(self, cache) -> None:
        cache = cache or os.path.join(self.folder, "compile_cache")
        os.makedirs(cache, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache)  # inductor reads it when it compiles
        for index, stage in self.stages.items():
            # sizes passed as ints (sym_inputs) are symbolic in the manifest: compile them symbolic from the
            # start (dynamo would specialise an int on first sight); tensors get their symbolic dims marked
            # by the executor before each call
            sizes = bool(self.manifest["stages"][index].get("sym_inputs"))
            if stage.local_shards or stage.cast_weights is not None:
                # tensor parallel: the DTensor parameters become shards outside the compiled code; params policy:
                # the compute copies are made there
                stage.function = torch.compile(stage.function, dynamic=True if sizes else None)
            else:
                stage.compile(dynamic=True if sizes else None)

    def _connect(self, actions, mode: str, ring_mb: float):
        """Shared-memory rings to this rank's pipeline peers on the same host (``shm_p2p``; collective)."""
        stage_to_rank = self._plan_manifest["plan"]["stage_to_rank"]
        send_to, receive_from = set(), set()
        for text in actions:
            stage, kind, _mb, peer = parse_action(text)
            if kind.startswith(("SEND", "RECV")) and peer is not None:
                target = dp_mesh.global_rank(self.layout, self.dp_index, stage_to_rank[peer], self.tp_index,
                                             self.cp_index)
                (send_to if kind.startswith("SEND") else receive_from).add(target)
        self._peers = (send_to, receive_from)
        transport, note = shm_p2p.connect(self.rank, send_to, receive_from, int(ring_mb * 2**20), mode,
                                          own_core=cpu_binding.has_own_core())
        if note is not None and self.rank == 0:
            print(f"[tracepp] note: {note}", flush=True)
        return transport

    def p2p_transport(self) -> str:
        """What carries this rank's pipeline messages: "shm" (every peer on this host), "shm+gloo", or the backend."""
        if self.transport is None:
            return self.backend or "none"
        send_to, receive_from = self._peers
        every = (all(self.transport.carries(p, True) for p in send_to)
                 and all(self.transport.carries(p, False) for p in receive_from))
        return "shm" if every else "shm+gloo"

    def _executor(self, actions, releases, training: bool) -> RankExecutor:
        executor = RankExecutor(self._plan_manifest, self.pp_rank, self.stages, actions, self.device, self.loss_fn,
                                self._timeout_s, self._out_spec, training, self._shapes, releases=releases,
                                wire_dtype=self._wire_dtype, input_dtype=self._input_dtype,
                                check_finite=self._check_finite,
                                split_weight_backward=not self.compiled and self.mesh is None,
                                mark_dynamic=self.compiled)
        if self.full_mesh is not None:
            executor.global_ranks = [dp_mesh.global_rank(self.layout, self.dp_index, pp, self.tp_index,
                                                         self.cp_index) for pp in range(self.layout.pp)]
            executor.pp_group = self.full_mesh["pp"].get_group()
        executor.transport = self.transport
        return executor

    @staticmethod
    def _last_backward_microbatch(actions) -> dict:
        """stage -> the microbatch of its last backward (B or I) in this rank's action list."""
        last = {}
        for text in actions:
            stage, kind, mb, _peer = parse_action(text)
            if kind in ("B", "I"):
                last[stage] = mb
        return last

    def _before_backward(self, stage_index: int, mb: int) -> None:
        # a split backward (I then W) reduces after the step (_reduce_split_backward), every backward unsynced
        last = mb == self._last_backward[stage_index] and not self._split_backward
        dp_mesh.set_last_backward(self.stages[stage_index], last)

    def _reduce_split_backward(self) -> None:
        """Data parallel under a zero-bubble schedule: each stage's gradients reduced once the step's last W ran."""
        for stage in self.stages.values():
            dp_mesh.reduce_after_split_backward(stage)

    def _shared_groups(self) -> list:
        """One process group per set of ranks holding copies of shared parameters, created in the same order on
        every rank; with it, this rank's copies and whether this rank counts them in the global norm."""
        stage_to_rank = self.manifest["plan"]["stage_to_rank"]
        by_ranks: dict = {}
        for shared in self.manifest["shared"]:
            ranks = sorted({stage_to_rank[s] for s in shared["stages"]})
            if len(ranks) > 1:
                by_ranks.setdefault(tuple(ranks), []).append(shared["fqn"])
        groups = []
        params = dict(self.named_parameters())
        for ranks, fqns in sorted(by_ranks.items()):
            for dp_index in range(self.layout.dp):  # one group per replica: its pipeline ranks holding a copy
                for tp_index in range(self.layout.tp):  # (and per tp place: each holds its own shards)
                    for cp_index in range(self.layout.cp):  # (and per cp place: FSDP's shard of dp x cp)
                        members = [dp_mesh.global_rank(self.layout, dp_index, r, tp_index, cp_index) for r in ranks]
                        group = dist.new_group(members)  # every rank calls new_group for every set, in order
                        if self.rank in members:
                            groups.append((group, [params[f] for f in fqns if f in params]))
        return groups

    def _counted_once(self) -> list:
        """[(how many ranks hold the same gradient, parameters)]: this rank's parameters less shared copies whose
        lowest holding rank is another (each weight once); under tp, the shards (counted on every tp rank) apart
        from the tensors replicated over tp (their tp copies divide out); over dp, FSDP's shards once and DDP's
        copies divided out; routed experts (sharded over ep, outside FSDP) once per ep group of the dp ranks."""
        stage_to_rank = self.manifest["plan"]["stage_to_rank"]
        owner = {shared["fqn"]: min(stage_to_rank[s] for s in shared["stages"]) for shared in self.manifest["shared"]}
        tp = self.layout.tp if self.tp_mesh is not None else 1
        dp = dp_mesh.replication_factor(self.layout) if self.mesh is not None else 1
        experts = {id(p) for p in self.expert_params} if self.ep_mesh is not None else set()
        scalars = {id(p) for p in getattr(self, "scalar_params", ())}  # whole on every dp x cp rank
        groups: dict = {}
        for name, param in self.named_parameters():
            if owner.get(name, self.pp_rank) == self.pp_rank:
                whole = tp > 1 and tensor_parallel.placement_of(self.manifest, name) is None
                holders = self.layout.dp * self.layout.cp // self.layout.ep
                copies = (tp if whole else 1) * (holders if id(param) in experts else
                                                 self.layout.dp * self.layout.cp if id(param) in scalars else dp)
                groups.setdefault(copies, []).append(param)
        return list(groups.items())

    # -- the plan's memory against this device ---------------------------------------------------------------
    def check_memory(self, mode: str = "on", reserve=None, optimizer=None) -> None:
        """Does the plan's peak fit (``memory_fit.check``)? A collective: every rank stops, naming the figures, if one
        does not. ``mode``: ``on`` refuses, ``warn`` only says so, ``off`` skips. ``reserve``: on CUDA what is kept
        free beside the peak for NCCL's buffers and the caching allocator's fragmentation (``"2GB"``, ``"10%"`` of
        the peak, or ``"1GB+10%"``; default ``memory_fit.CUDA_RESERVE``). ``optimizer``: the one the loop builds, where
        the model file has none (sgd, adamw), when it is not the split's. The constructor runs it (its
        ``memory_check`` and ``memory_reserve``); run.py runs it after building its optimizer."""
        if mode == "off" or self._all_stages or not self.training:
            return
        unnamed = []  # the constructor named its own differences
        if optimizer is not None and not hasattr(self.user, "optimizer"):
            unnamed = run_options.chosen(self.manifest, optimizer=optimizer)[1]
        memory_fit.check(self, mode, reserve, differs=self.run_differs + unnamed, unnamed=unnamed)

    # -- the step API ---------------------------------------------------------------------------------------
    def register_step_hook(self, hook):
        """Call ``hook(pipeline, step_index)`` before each :meth:`step` of this pipeline; returns a remover."""
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook)

    def set_action_hook(self, hook) -> None:
        """``hook(action_text, run)`` is called for every action of a step instead of ``run()`` (e.g. to time
        each action); None restores plain execution."""
        self.executor.action_hook = hook

    def step(self, args, kwargs=None, target=None):
        """One pipelined forward and backward of the full batch ``(args, kwargs)``: gradients accumulate in this
        rank's stages. Returns the full-batch loss (a detached fp32 tensor) on the last stage's rank, None
        elsewhere. Every rank must call it with the same batch (each keeps only what its stages read)."""
        for hook in _STEP_HOOKS + self._hooks:
            hook(self, self.steps_run)
        result = self._run(self.executor, args, kwargs, target)
        self.steps_run += 1
        return result

    def eval_step(self, args, kwargs=None, target=None):
        """Forward only, no gradients: the plan's forward actions. On the last stage's rank returns the loss
        (with ``target`` and a loss function) or the list of per-microbatch outputs; None elsewhere."""
        if self._eval_executor is None:
            forward_only = [a for a in self.executor.actions if parse_action(a)[1] in ("F", "SEND_F", "RECV_F")]
            # no send-release points ({}): a forward-only step waits on its sends at the end of the step
            self._eval_executor = self._executor(forward_only, {}, False)
        with torch.no_grad():
            return self._run(self._eval_executor, args, kwargs, target)

    def _run(self, executor, args, kwargs, target):
        if not isinstance(args, tuple):
            args = tuple(args) if isinstance(args, list) else (args,)
        tokens = None  # a token-mean loss: the global batch's counted tokens, each replica's weighed against them
        if self.layout.dp > 1:
            if self.splitter.token_mean is not None and target is not None:
                tokens = (self.splitter.token_total(args, kwargs, target), self.layout.dp)
            args, kwargs, target = self._replica_slice(args, kwargs or {}, target)
        batches = self.splitter.split(self.steps_run, args, kwargs or {}, target, self.device, tokens)
        executor.loss_scale = self.loss_scale
        self.last_batch_size = batches.batch_size * self.layout.dp
        sums = self._step_sums if self.training and executor is self.executor else None
        if sums is not None:
            sums.begin()
        result = executor.run_step(batches.leaves, batches.targets, batches.scales, batches.symbols)
        if self.mesh is not None and self.training and self._split_backward and executor is self.executor:
            self._reduce_split_backward()
        if sums is not None:  # replicated parameters read by sharded ops: each rank's part summed over tp, once
            sums.end()
        if not self.is_last_rank:
            return None
        if self.mesh is not None and isinstance(result, torch.Tensor):  # the global batch's loss: replicas' mean
            result = result / self.layout.dp
            dist.all_reduce(result, group=self.replicas.get_group())
        return result

    def _replica_slice(self, args, kwargs, target):
        """This replica's contiguous slice (dp_index-th of N) of every batched input and of the target."""
        import torch.utils._pytree as pytree

        dp = self.layout.dp
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        batched = self.splitter.batched
        if len(batched) != len(leaves):  # a batch of another structure: the splitter names what differs
            return args, kwargs, target
        dim = self.splitter.batch_dim
        size = next((leaf.shape[dim] for leaf, b in zip(leaves, batched) if b and isinstance(leaf, torch.Tensor)
                     and leaf.dim() > dim), None)
        if size is None and any(batched):
            raise PipelineError(f"batch for step {self.steps_run}: no batched input has the batch dim {dim} "
                                f"(batch_dim); batch(step) must lay its inputs out as example_inputs() does")
        if size is None or size % dp:
            works = f"a multiple of {dp}" if size is None else (
                f"{size - size % dp} or {size - size % dp + dp}" if size >= dp else f"{dp} or a multiple of it")
            raise PipelineError(f"batch for step {self.steps_run} has {size} samples, which the {dp} data-parallel "
                                f"replicas cannot share equally: use a global batch of {works}")
        per = size // dp
        begin = self.dp_index * per

        def cut(leaf, is_batched=True):
            if is_batched and isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == size:
                return leaf.narrow(dim, begin, per)
            return leaf
        leaves = [cut(leaf, b) for leaf, b in zip(leaves, batched)]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return args, kwargs, pytree.tree_map(cut, target)

    # -- gradients ------------------------------------------------------------------------------------------
    def sync_shared_grads(self) -> None:
        """Sum the gradients of weights held on several ranks (a tied embedding and head) across those ranks,
        so every copy takes the same optimizer step; with expert parallelism, reduce each expert's gradient over
        the ranks that hold it. Call once after the last ``step`` before the optimizer."""
        if self.ep_mesh is not None and self.training:
            expert_parallel.reduce_expert_grads(self.expert_params, self.expert_replicas,
                                                self.layout.dp * self.layout.cp)
        if self.scalar_params and self.training:
            dp_mesh.reduce_scalar_grads(self.scalar_params, self.mesh, self.layout, self.grad_mesh)
        for group, params in self._shared:
            grads = []
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(dp_mesh.local(param.grad))  # with FSDP: this replica's shard, the same on each copy
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def grad_norm(self, *, nonfinite_loss: bool = False, stop_requested: bool = False) -> torch.Tensor:
        """The global L2 norm of the gradients of every stage on every rank, a shared weight counted once: one
        all-reduce of three numbers; the same fp32 value on every rank. Call after :meth:`sync_shared_grads`.
        ``nonfinite_loss=True`` (on the rank whose loss was NaN/inf) makes it NaN on every rank.
        ``stop_requested`` rides along: afterwards ``self.stop_agreed`` is True on every rank if it was True on
        any (a signal asked one rank to stop: run.py saves and stops on all of them after this step)."""
        sums = torch.zeros(3, device=self.device, dtype=torch.float32)
        # a gradient held by several ranks (replicated over tp, DDP's copies over dp, an expert's copies over the
        # replica groups) is divided by their number: counted once over the world
        for replicas, params in self._counted_once():
            grads = [dp_mesh.local(p.grad).detach() for p in params if p.grad is not None]
            if grads:  # with DP: local shards, each shard counted once over the mesh (replicas divide it out)
                # one fused kernel for every tensor's norm (as torch.nn.utils.clip_grad_norm_), not two ops each
                norms = torch._foreach_norm(grads) if len({(g.device, g.dtype) for g in grads}) == 1 else \
                    [torch.linalg.vector_norm(g) for g in grads]
                sums[0] += torch.stack([n.float() for n in norms]).pow(2).sum() / replicas
        sums[1] = float(nonfinite_loss)
        sums[2] = float(stop_requested)
        if self.world_size > 1:
            dist.all_reduce(sums)
        self.stop_agreed = bool(sums[2] > 0)
        norm = sums[0].sqrt()
        return torch.full_like(norm, float("nan")) if sums[1] > 0 else norm

    def expert_load(self):
        """Tokens per routed expert in the step just run, over the global batch (summed over the data-parallel
        replicas), across every block of the pipeline: ``{"imbalance": the worst block's busiest expert over its
        mean, "max": the tokens of the busiest expert of any block, "mean": tokens per expert (the largest
        block mean), "dropped": (token, expert) pairs no expert took (0: dropless)}``, the same on every rank;
        None for a model without routed experts. A collective: call it on every rank."""
        if not (self.manifest.get("ep") or {}).get("blocks"):
            return None
        stats = expert_parallel.take_stats()
        if self.mesh is not None and stats:  # each replica counted its own tokens
            flat = torch.cat([torch.cat([counts.float(), torch.tensor([float(dropped)])])
                              for counts, dropped in stats.values()]).to(self.device)
            dist.all_reduce(flat, group=self.token_group or self.replicas.get_group())
            offset, summed = 0, {}
            for block, (counts, _dropped) in stats.items():
                size = counts.numel()
                summed[block] = (flat[offset:offset + size].cpu(), float(flat[offset + size]))
                offset += size + 1
            stats = summed
        worst = torch.zeros(4, dtype=torch.float64)  # imbalance, max, mean, dropped (over this rank's blocks)
        for counts, dropped in stats.values():
            counts = counts.double()
            mean = float(counts.mean())
            worst[0] = max(float(worst[0]), float(counts.max()) / mean if mean > 0 else 0.0)
            worst[1] = max(float(worst[1]), float(counts.max()))
            worst[2] = max(float(worst[2]), mean)
            worst[3] += dropped
        if self.world_size > 1 and self.layout.pp > 1:
            # the worst block of any pipeline rank (dropped: the most any rank saw); with one pipeline rank every
            # rank holds the same blocks and, summed over the replicas above, the same counts
            result = worst.to(self.device, torch.float32)
            dist.all_reduce(result, op=dist.ReduceOp.MAX)
            worst = result.double().cpu()
        else:
            worst = worst.float().double()  # the same figures either way (float32, as the all-reduce carries them)
        return {"imbalance": float(worst[0]), "max": float(worst[1]), "mean": float(worst[2]),
                "dropped": int(worst[3])}

    def scale_grads(self, factor) -> None:
        for param in self.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)

    def clip_grad_norm_(self, max_norm: float, norm=None) -> torch.Tensor:
        """Scale every gradient by ``max_norm / (norm + 1e-6)`` when that is below 1, as
        ``torch.nn.utils.clip_grad_norm_`` does for one model; ``norm`` defaults to :meth:`grad_norm`.
        Returns the norm before clipping (the same on every rank)."""
        norm = self.grad_norm() if norm is None else norm
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self.scale_grads(coefficient)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.stages.values():
            stage.zero_grad(set_to_none=set_to_none)

    def nonfinite_report(self, loss=None) -> str:
        """Where the last step first went non-finite, the same text on every rank (a collective; call it on
        every rank): the loss (pass it on the last stage's rank), then the lowest stage whose output held a
        NaN/inf and its first such microbatch, else that every output was finite. Needs ``check_finite``."""
        mine = (self.executor.nonfinite_outputs(), loss)
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        found = sorted(item for part, _loss in gathered for item in part)
        losses = [value for _part, value in gathered if value is not None]
        text = f"loss {losses[0]}; " if losses else ""
        if not found:
            return text + "every stage's outputs were finite (the loss function or the backward produced it)"
        stage, microbatch = found[0]
        rank = self.manifest["plan"]["stage_to_rank"][stage]
        modules = ", ".join(self.manifest["stages"][stage]["module_fqns"]) or "-"
        return text + (f"the output of stage {stage} (rank {rank}; modules {modules}) went non-finite first, "
                       f"at microbatch {microbatch}")

    # -- parameters and state -------------------------------------------------------------------------------
    def named_parameters(self):
        """(original FQN, parameter) for this rank's stages; a weight two local stages share appears once."""
        seen = set()
        for stage in self.stages.values():
            for name, param in stage.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self):
        return [param for _name, param in self.named_parameters()]

    def state_dict(self) -> dict:
        """This rank's parameters and persistent buffers under the original FQNs (detached, sharing storage, so
        loading into them loads the model); with FSDP they are DTensors (``mesh.full`` gathers one whole)."""
        state = {}
        for stage in self.stages.values():
            for name, tensor in stage.state_dict().items():
                state.setdefault(name, tensor)
        return state

    def train(self, mode: bool = True):
        for stage in self.stages.values():
            stage.train(mode)
        return self

    def eval(self):
        return self.train(False)
