"""The training options that change a rank's memory, chosen at split time and defaulted to by run.py.

``tracepp split --precision bf16 --activation-checkpointing selective --optimizer adamw`` plans memory for them
(``tracepp inspect`` prints the peak per rank they give) and records them in the manifest as ``run_options``;
``run.py`` uses them unless its own flags say otherwise, so the job that runs is the one that was planned.
One value, like the parallel layout (``mesh.Layout``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .precision import FP8_RECIPES, MIXED_MODES, PRECISIONS

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class RunOptions:
    """``precision``: compute dtype (fp32, bf16, fp16, fp8: bf16 with float8 linears); ``mixed_precision``: how a
    precision below fp32 is applied (``runtime/precision.py``): ``params`` (parameters cast to the compute dtype once
    per step, fp32 masters and reductions; the stage code is traced so) or ``autocast`` (fp32 parameters, autocast per
    op; traced in fp32); ``fp8_recipe``: torchao's scaling under fp8 (tensorwise, rowwise). ``activation_checkpointing``: a mode
    of ``recompute`` (none, full, selective, in-flight, or one per stage, comma-separated). ``optimizer``: what
    run.py's ``--optimizer`` builds when the model file has no ``optimizer(params)`` (sgd, adamw; None: sgd).
    ``expert_imbalance``: an assumption about the data, not an option of the run: with expert parallelism the
    rows a rank receives for its experts, over the balanced count (1.0), that memory is planned for. ``device``:
    where the job will run (cpu: gloo, cuda: NCCL), for what its collectives and optimizer allocate; run.py takes
    CUDA wherever it is available. ``memory_limit``: bytes a rank may hold at its peak: with
    ``activation_checkpointing="auto"`` the split chooses each stage's checkpointing to fit it (and records the
    choice, which run.py applies); with another mode the split refuses a plan over it."""

    precision: str = "fp32"
    mixed_precision: str = "params"
    fp8_recipe: str = "tensorwise"
    activation_checkpointing: str = "none"
    optimizer: Optional[str] = None
    expert_imbalance: float = 1.0
    device: str = "cpu"
    memory_limit: Optional[int] = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Optional[dict]) -> "RunOptions":
        known = {k: v for k, v in (data or {}).items() if k in {f.name for f in dataclasses.fields(cls)}}
        if data and "mixed_precision" not in data:  # split before the params policy: traced in fp32, autocast
            known["mixed_precision"] = "autocast"
        return cls(**known)

    def traced_dtype(self):
        """The dtype the folder's parameters were traced in (None: their own; ``precision.traced_dtype``)."""
        from .precision import traced_dtype

        return traced_dtype(self.precision, self.mixed_precision)

    def replace(self, **changes) -> "RunOptions":
        return dataclasses.replace(self, **changes)

    def check(self, num_stages: Optional[int] = None) -> None:
        from .recompute import check_mode

        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.mixed_precision not in MIXED_MODES:
            raise ValueError(f"--mixed-precision {self.mixed_precision!r} is not one of {', '.join(MIXED_MODES)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe {self.fp8_recipe!r} is not one of {', '.join(FP8_RECIPES)}")
        if self.precision == "fp8" and self.mixed_precision == "autocast":
            raise ValueError("--precision fp8 runs torchao's float8 linears with bf16 parameters cast once per step "
                             "(--mixed-precision params); with --mixed-precision autocast use --precision bf16")
        if self.precision == "fp8" and self.device != "cuda":
            raise ValueError("--precision fp8 trains torchao's float8 linears on a CUDA GPU (compute capability 8.9 or "
                             f"more); this plan is for --device {self.device}: plan with --device cuda, or use "
                             "--precision bf16")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.activation_checkpointing == "auto":
            if self.memory_limit is None:
                raise ValueError("--activation-checkpointing auto chooses each stage's checkpointing to fit a limit: "
                                 "give --memory-limit SIZE (e.g. 80GB)")
        else:
            check_mode(self.activation_checkpointing, num_stages)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: plan for cpu or cuda")
        if not 1.0 <= self.expert_imbalance:
            raise ValueError(f"--expert-imbalance {self.expert_imbalance}: give 1 (balanced routing) or more (the "
                             f"busiest expert over the mean, as run.py's metrics report it)")


def manifest_options(manifest: dict) -> RunOptions:
    """What the folder was planned for (fp32, no checkpointing, sgd for a folder split before these were recorded)."""
    return RunOptions.from_json(manifest.get("run_options"))


def chosen(manifest: dict, **given) -> tuple:
    """The run options a job runs with: the split's (``run_options``), each of ``given`` (``precision``,
    ``activation_checkpointing``, ``optimizer``) that is not None in its place. Returns ``(RunOptions, differs)``:
    ``differs`` names each given option that is not what the split planned (``precision fp32 (planned bf16)``).
    The one place the runtime reads "the precision" and "the checkpointing" of a folder: run.py and
    ``Pipeline(folder)`` both call it."""
    planned = manifest_options(manifest)
    changes = {name: value for name, value in given.items() if value is not None}
    run = planned.replace(**changes)
    differs = []
    for name, value in changes.items():
        was = getattr(planned, name) if name != "optimizer" else (planned.optimizer or "sgd")
        if value != was:
            differs.append(f"{name.replace('_', ' ')} {value} (planned {was})")
    return run, differs


def fill_defaults(args, manifest: dict) -> None:
    """run.py's ``--precision``, ``--activation-checkpointing`` and ``--optimizer`` left unset take the split's."""
    planned = manifest_options(manifest)
    if getattr(args, "precision", None) is None:
        args.precision = planned.precision
    if getattr(args, "activation_checkpointing", None) is None:
        args.activation_checkpointing = planned.activation_checkpointing
    if getattr(args, "optimizer", None) is None:
        args.optimizer = planned.optimizer or "sgd"
