"""Mixed precision as torchtitan and Megatron train: parameters cast to the compute dtype once per step, fp32 master
weights, optimizer state and gradient reductions; or, on request, ``torch.autocast``.

``--precision bf16`` (or fp16, or fp8) with ``--mixed-precision params`` (the default) is FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on every layout:

* the rank holds its parameters in their own dtype (fp32): the master weights the optimizer updates, and that
  ``--save`` and checkpoints write;
* a stage computes with a bf16 copy of them, made once per step at the stage's first forward and dropped after its
  last backward: under FSDP/HSDP, FSDP2 all-gathers that copy (half the bytes of an fp32 gather); under DDP
  (``replicate``, on FSDP2's machinery) it casts it; without data parallelism (and for routed experts, which FSDP
  leaves alone) :class:`CastWeights` makes it;
* each backward's gradients (bf16, on the copy) are added into an fp32 gradient, as FSDP2 accumulates with
  ``reduce_dtype=fp32``, and FSDP reduce-scatters (DDP all-reduces) them in fp32;
* the stage code was traced with the parameters in bf16 (``tracepp split`` casts them, and the model's floating
  inputs, before ``torch.export``), so every op computes in the dtype eager training under the same policy computes
  in: bf16 where the model computes from its weights, fp32 where it upcasts itself (a norm's variance) or reads fp32
  buffers; nothing is cast per op. Boundary tensors travel in the dtype they were traced in (bf16 activations and
  their gradients; a value the model keeps in fp32 stays fp32); the loss is computed in fp32.

``--mixed-precision autocast`` keeps the parameters fp32 and runs each stage under ``torch.autocast``: for a model
that mixes its weights' dtype with fp32 tensors it never casts (a rotary table built from an fp32 buffer and
multiplied into bf16 queries, which ``scaled_dot_product_attention`` then refuses), or that relies on autocast's
fp32 ops (softmax, norms) for accuracy. Its stage code is traced in fp32, so run.py may run it at any precision.

``--precision fp8`` is the bf16 policy above with torchao's float8 training on the linears (``aten.linear`` of a
parameter whose dims 16 divides, as ``torchao.float8.convert_to_float8_training`` converts ``nn.Linear``):
tensorwise or rowwise scaling (``--fp8-recipe``), and under FSDP with tensorwise scaling the weights all-gathered in
float8. It needs CUDA with compute capability 8.9 or more and the ``torchao`` package, which is imported here only
when fp8 is asked for (the runtime needs torch alone otherwise).
"""
from __future__ import annotations

import types
from typing import Optional

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
MIXED_MODES = ("params", "autocast")
FP8_RECIPES = ("tensorwise", "rowwise")
# the dtype the non-linear ops compute in: fp8 runs its linears in float8 and everything else in bf16
COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
# torchao's float8 linear takes dims 16 divides (torch._scaled_mm's alignment)
FP8_ALIGNMENT = 16


def compute_dtype(precision: str) -> Optional[torch.dtype]:
    return COMPUTE_DTYPES[precision]


def traced_dtype(precision: str, mixed_precision: str) -> Optional[torch.dtype]:
    """The dtype a folder's parameters were traced in (None: their own, fp32): the compute dtype under
    ``--mixed-precision params``; autocast folders are traced in fp32."""
    if mixed_precision == "autocast":
        return None
    return COMPUTE_DTYPES[precision]


def cast_floating(value, dtype: Optional[torch.dtype]):
    """A floating tensor in ``dtype`` (the model's inputs under the params policy, as FSDP2's ``cast_forward_inputs``
    casts the root module's); anything else as it is."""
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def describe(precision: str, mixed_precision: str, fp8_recipe: str = "tensorwise") -> str:
    """One line for run.py's banner and the rank scripts' header: what is held, computed and sent in which dtype."""
    if precision == "fp32":
        return "precision fp32: parameters, compute, boundary tensors, loss and gradients fp32"
    half = "bf16" if precision == "fp8" else precision
    if mixed_precision == "autocast":
        text = (f"precision {half}: parameters fp32 (master weights), compute {half} (autocast per stage), boundary "
                f"tensors sent as {half}, loss fp32, shared-weight gradients reduced in fp32")
    else:
        text = (f"precision {precision}: parameters fp32 (master weights and optimizer state), cast to {half} once "
                f"per step (FSDP2 MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=fp32): gathered and computed "
                f"in {half}), gradients accumulated and reduced in fp32, boundary tensors sent as traced ({half} "
                f"activations), loss fp32")
        if precision == "fp8":
            text += f"; linears in float8 ({fp8_recipe} scaling, torchao)"
    return text + (", dynamic loss scale" if precision == "fp16" else "")


def mp_policy(precision: str, mixed_precision: str):
    """FSDP2's policy for ``fully_shard``/``replicate`` under the params policy (None otherwise). Forward inputs are
    not cast by FSDP: the stage code says each input's dtype (the executor casts the model's own inputs, and a
    boundary value the model keeps in fp32 arrives in fp32)."""
    dtype = traced_dtype(precision, mixed_precision)
    if dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class CastWeights:
    """The compute copies of one stage's parameters where no FSDP/DDP engine makes them (no data parallelism, or
    routed experts, which FSDP leaves alone): made once per step at the stage's first forward, detached leaves in
    ``dtype`` that the stage function computes with; :meth:`accumulate` after each backward adds their gradients
    into the masters' in the masters' dtype (fp32), as FSDP2 accumulates with ``reduce_dtype``; :meth:`release`
    drops them after the stage's last backward of the step (the optimizer then updates the masters)."""

    def __init__(self, masters: list, dtype: torch.dtype):
        self.masters = [p for p in masters if p.is_floating_point() and p.dtype != dtype]
        self.dtype = dtype
        self.slot = {id(p): i for i, p in enumerate(self.masters)}
        self.copies = None

    def __bool__(self) -> bool:
        return bool(self.masters)

    def make(self) -> list:
        if self.copies is None:
            with torch.no_grad():
                self.copies = [p.detach().to(self.dtype).requires_grad_(p.requires_grad) for p in self.masters]
        return self.copies

    def swap(self, tensors: list) -> list:
        """``tensors`` (a stage's state, masters among them) with each master replaced by its compute copy."""
        copies = self.make()
        slot = self.slot
        return [copies[slot[id(t)]] if id(t) in slot else t for t in tensors]

    def leaves(self) -> list:
        """What a backward reaches for each master: its copy while the step holds one, else the master."""
        return list(self.copies) if self.copies is not None else list(self.masters)

    def accumulate(self) -> None:
        if self.copies is None:
            return
        with torch.no_grad():
            for master, copy in zip(self.masters, self.copies):
                grad = copy.grad
                if grad is None:
                    continue
                copy.grad = None
                if master.grad is None:
                    master.grad = grad.to(master.dtype)
                else:
                    _local(master.grad).add_(_local(grad))

    def release(self) -> None:
        self.accumulate()
        self.copies = None


# -- fp8 (torchao, imported only here and only when asked for) -------------------------------------------------

def fp8_problem(device: torch.device) -> Optional[str]:
    """Why ``--precision fp8`` cannot run on ``device`` (None: it can), with what would work."""
    if device.type != "cuda":
        return (f"--precision fp8 trains the linears in float8 with torchao, which needs a CUDA GPU of compute "
                f"capability 8.9 or more (Ada, Hopper, Blackwell); this job runs on {device.type}: use --precision "
                f"bf16 (the same policy, bf16 linears)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"--precision fp8 needs float8 matmuls (compute capability 8.9 or more: L4, L40, H100, H200, B200); "
                f"{name} has {major}.{minor}: use --precision bf16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        return (f"--precision fp8 trains the linears with torchao's float8 ({type(error).__name__}: {error}): "
                f"pip install torchao (a version built for torch {torch.__version__.split('+')[0]}), or use "
                f"--precision bf16")
    return None


def fp8_eligible(weight: torch.Tensor) -> bool:
    """A linear's weight torchao's float8 takes: 2-D, both dims divisible by 16 (its ``module_filter_fn`` default)."""
    return weight.dim() == 2 and all(size % FP8_ALIGNMENT == 0 for size in weight.shape)


class Float8Linears:
    """``aten.linear(x, w, b)`` of a stage's parameters as torchao's float8 matmul (its ``Float8Linear.forward``
    without the module: ``matmul_with_hp_or_float8_args`` with the ``LinearMMConfig`` Float8Linear builds), for
    weights :func:`fp8_eligible` takes; other linears run as they were. :meth:`bind` installs it as the
    ``torch.ops.aten.linear.default`` a rank script's functions call. ``emulate``: torchao's emulation of the
    float8 matmuls in high precision (its tests' mode; the runtime refuses fp8 off CUDA)."""

    def __init__(self, recipe: str, emulate: bool = False):
        import dataclasses

        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        config = Float8LinearConfig.from_recipe_name(recipe)
        self.config = dataclasses.replace(config, emulate=emulate) if emulate else config
        self.matmul = matmul_with_hp_or_float8_args
        c = self.config
        # as Float8Linear.__init__ builds it: the output, grad_input and grad_weight gemms
        self.mm_config = LinearMMConfig(
            ScaledMMConfig(c.emulate, c.gemm_config_output.use_fast_accum, False, c.pad_inner_dim),
            ScaledMMConfig(c.emulate, c.gemm_config_grad_input.use_fast_accum, False, c.pad_inner_dim),
            ScaledMMConfig(c.emulate, c.gemm_config_grad_weight.use_fast_accum, False, c.pad_inner_dim))
        self.plain = torch.ops.aten.linear.default

    def linear(self, x, weight, bias=None):
        if not fp8_eligible(weight):
            return self.plain(x, weight, bias)
        out = self.matmul.apply(x, weight.t(), self.mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)

    def bind(self, function) -> None:
        """Make ``function``'s module (a rank script: its stage and block functions) call :meth:`linear` for
        ``torch.ops.aten.linear.default``; every other name as before (``fast_ops.FastTorch`` or torch)."""
        scope = getattr(function, "__globals__", None)
        if isinstance(scope, dict) and not isinstance(scope.get("torch"), _Float8Torch):
            scope["torch"] = _Float8Torch(scope.get("torch", torch), self.linear)

    def gathered_weights(self, stages: dict, manifest: dict) -> int:
        """FSDP with tensorwise scaling: wrap each linear weight torchao's float8 takes (the manifest's
        ``linear_weight``) as torchao's ``WeightWithDynamicFloat8CastTensor`` before ``fully_shard``, so FSDP
        all-gathers it in float8 (``Float8LinearConfig.enable_fsdp_float8_all_gather``). Returns how many."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        if self.config.cast_config_weight.scaling_granularity is not ScalingGranularity.TENSORWISE:
            return 0  # torchao gathers in float8 for tensorwise scaling only
        target = self.config.cast_config_weight.target_dtype
        uses: dict = {}  # id(parameter) -> [(owner, name, read as a linear's weight there)] over this rank's stages
        for index, stage in stages.items():
            refs = manifest["stages"][index]["state"]
            for ref, (owner, name) in zip(refs, stage._state_paths):
                param = owner._parameters.get(name)
                if param is not None:
                    uses.setdefault(id(param), []).append((owner, name, bool(ref.get("linear_weight"))))
        wrapped = 0
        for places in uses.values():
            owner, name, _linear = places[0]
            param = owner._parameters[name]
            if not all(linear for _o, _n, linear in places) or not fp8_eligible(param):
                continue  # a weight some stage reads otherwise (a tied embedding) stays as it is
            replacement = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(param.data, self.mm_config, target),
                                             requires_grad=param.requires_grad)
            for owner, name, _linear in places:
                owner._parameters[name] = replacement
            wrapped += 1
        return wrapped


class _Float8Ops:
    """``torch.ops`` with ``aten.linear.default`` replaced (see :class:`_Float8Torch`)."""

    def __init__(self, ops, linear):
        self._ops, self._linear = ops, linear

    def __getattr__(self, name):
        value = getattr(self._ops, name)
        if name == "aten":
            value = _Float8Aten(value, self._linear)
        setattr(self, name, value)
        return value


class _Float8Aten:
    def __init__(self, aten, linear):
        self._aten, self._linear = aten, linear

    def __getattr__(self, name):
        value = getattr(self._aten, name)
        if name == "linear":
            value = _Float8Packet(value, self._linear)
        setattr(self, name, value)
        return value


class _Float8Packet:
    def __init__(self, packet, linear):
        self._packet, self.default = packet, linear

    def __getattr__(self, name):
        return getattr(self._packet, name)


class _Float8Torch(types.ModuleType):
    """``torch`` for a rank script under ``--precision fp8``: ``ops.aten.linear.default`` is the float8 linear, every
    other name the script's own ``torch`` (torch, or ``fast_ops.FastTorch``)."""

    def __init__(self, base, linear):
        super().__init__("torch", torch.__doc__)
        self._base = base
        self.ops = _Float8Ops(base.ops, linear)

    def __getattr__(self, name):
        return getattr(self._base, name)


def plain(tensor):
    """A parameter as a plain tensor (torchao's float8-gathered weight wrapper unwrapped) for ``--save``."""
    inner = getattr(tensor, "_tensor", None)
    return inner if type(tensor).__name__ == "WeightWithDynamicFloat8CastTensor" and inner is not None else tensor


def resolve(planned, requested: Optional[str]) -> tuple:
    """(precision, mixed precision mode) a run uses: ``requested`` (run.py's ``--precision``, the Pipeline's
    ``precision``; None: the folder's) with the mode its stage code allows. ``planned``: the folder's
    ``RunOptions``. Stage code traced in fp32 (``--precision fp32``, or ``--mixed-precision autocast``) runs at
    fp32 or under autocast at bf16/fp16; stage code traced with bf16 (fp16) parameters runs only in that compute
    dtype (bf16 or fp8 for bf16). Anything else raises ``ValueError`` naming what to run or re-split."""
    precision = planned.precision if requested is None else requested
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    traced = planned.traced_dtype()
    if traced is None:
        if precision == "fp8":
            raise ValueError("--precision fp8 runs the stage code traced with bf16 parameters, and this folder's was "
                             f"traced in fp32 (tracepp split --precision {planned.precision}"
                             + (" --mixed-precision autocast" if planned.mixed_precision == "autocast" else "")
                             + "): re-split with --precision fp8")
        return precision, "autocast"
    if COMPUTE_DTYPES[precision] != traced:
        same = [name for name, dtype in COMPUTE_DTYPES.items() if dtype == traced]
        raise ValueError(f"this folder's stage code was traced with {str(traced).replace('torch.', '')} parameters "
                         f"(tracepp split --precision {planned.precision}, --mixed-precision params), so it runs at "
                         f"--precision {' or '.join(same)}; for --precision {precision} re-split with it (or with "
                         f"--mixed-precision autocast, whose stage code is traced in fp32 and runs at fp32, bf16 or "
                         f"fp16)")
    return precision, "params"
