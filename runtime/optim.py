"""Build this rank's optimizer and LR scheduler: from the model file's hooks, else from the command-line flags.

Model-file hooks (both optional):

* ``optimizer(params)``: receives a list of this rank's parameter tensors (original behaviour);
  ``optimizer(named_params)`` (the first argument *named* ``named_params``) receives a list of
  ``(fqn, parameter)`` pairs under the original model's FQNs, so parameter groups can be chosen by name
  (e.g. no weight decay on norms and biases). Either may return any ``torch.optim.Optimizer``.
* ``lr_scheduler(optimizer)``: returns a ``torch.optim.lr_scheduler`` object, stepped once per training step
  after ``optimizer.step()``.

Without hooks the flags decide: ``--optimizer sgd|adamw`` (AdamW's fused kernel where the parameters allow it),
``--lr``, ``--weight-decay`` (AdamW/SGD; applied to
parameters with 2 or more dims only, never to biases and norm weights), ``--warmup N`` (linear warm-up over the
first N steps to ``--lr``, then cosine decay to 0 at ``--steps``; without it the rate stays ``--lr``).
A weight held by several ranks (a tied embedding and head) has the same FQN on each, its gradients are summed
across them before the step, and each rank builds the same optimizer for it: the copies stay identical.
"""
from __future__ import annotations

import inspect
import math

import torch

from .failure import PipelineError

OPTIMIZERS = ("sgd", "adamw")


class OptimizerConfigError(PipelineError, ValueError):
    """A model-file optimizer/scheduler hook or an optimizer flag that cannot be used; the message says why."""


def wants_named(function) -> bool:
    """True when the hook's first parameter is named ``named_params``: it gets (fqn, parameter) pairs."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return bool(parameters) and parameters[0] == "named_params"


def decay_groups(named_params: list, weight_decay: float) -> list:
    """Two parameter groups: weight decay for matrices (dim >= 2), none for biases and norm weights."""
    decay = [p for _name, p in named_params if p.dim() >= 2]
    no_decay = [p for _name, p in named_params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(user, named_params: list, *, name: str = "sgd", lr: float = 0.01, weight_decay: float = 0.0):
    """The model file's ``optimizer`` hook if it has one, else ``name`` (sgd|adamw) built from the flags."""
    make = getattr(user, "optimizer", None)
    if make is not None:
        argument = list(named_params) if wants_named(make) else [p for _name, p in named_params]
        optimizer = make(argument)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerConfigError(f"the model file's optimizer(...) returned {type(optimizer).__name__}, not a "
                             f"torch.optim.Optimizer: return e.g. torch.optim.AdamW(params, lr=1e-3)")
        return optimizer
    if name not in OPTIMIZERS:
        raise OptimizerConfigError(f"--optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}; for another optimizer "
                         f"define optimizer(params) in the model file")
    groups = decay_groups(named_params, weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, fused=fused_supported([p for _name, p in named_params]))
    return torch.optim.SGD(groups, lr=lr)


def fused_supported(params: list) -> bool:
    """AdamW's fused kernel (one pass per tensor, no temporaries the size of a parameter; faster on CPU and GPU)
    for plain floating tensors on CPU or CUDA; FSDP/DDP's DTensor parameters keep the default implementation."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda")
                                and p.is_floating_point() for p in params)


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier of scheduler step ``s`` (0 before the first optimizer step): ``(s + 1) / warmup`` during
    warm-up, then ``0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))``, reaching 0 at ``total``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))
    return factor


def build_scheduler(user, optimizer, *, warmup: int = 0, total_steps: int = 0):
    """The model file's ``lr_scheduler(optimizer)`` if present, else warm-up + cosine when ``warmup > 0``,
    else None (constant learning rate)."""
    make = getattr(user, "lr_scheduler", None)
    if make is not None:
        try:
            return make(optimizer)
        except Exception as error:
            raise OptimizerConfigError(f"the model file's lr_scheduler(optimizer) raised {type(error).__name__}: {error}; "
                             f"it must return a torch.optim.lr_scheduler object for the optimizer it is given"
                             ) from error
    if warmup < 0:
        raise OptimizerConfigError(f"--warmup {warmup} must be 0 or more steps")
    if warmup == 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total_steps))


def step_scheduler(scheduler, step: int) -> None:
    """Step the scheduler once; an exception in it becomes a ValueError naming the step and the scheduler."""
    if scheduler is None:
        return
    try:
        scheduler.step()
    except Exception as error:
        raise OptimizerConfigError(f"the LR scheduler {type(scheduler).__name__} raised {type(error).__name__} at step "
                         f"{step + 1}: {error}; fix lr_scheduler(optimizer) in the model file") from error


def parameter_fqns(optimizer, named_params: list) -> list:
    """For each parameter of ``optimizer`` in its own order (groups, then params), the parameter's FQN."""
    by_id = {id(p): name for name, p in named_params}
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise OptimizerConfigError("the optimizer holds a parameter that is not one of this rank's stage parameters: "
                                 "build it from the params passed to optimizer(...)")
            names.append(by_id[id(param)])
    return names
