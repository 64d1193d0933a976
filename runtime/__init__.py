"""tracepp's runtime: what generated rank scripts import. Depends on torch and the standard library only (and
numpy, which torch.distributed itself needs to exchange objects between ranks: ``distributed.missing_dependency``).

The emit step copies this package into every output folder as ``tracepp_runtime``, so a pipeline runs on a
machine that has torch but not tracepp. Layers, each usable alone: ``executor`` runs one step of a rank's
action list; ``pipeline.Pipeline`` owns this rank's stages as modules and exposes ``step``; ``launch`` is
the training loop of ``run.py``, built on ``Pipeline``. ``actions`` (the action vocabulary), ``replay`` (the one
replay engine and validator) and ``script_check`` (an edited rank script runs as edited or is refused) use the
standard library only; the planner, ``tracepp.codegen``, imports them from here, so one engine judges a plan at
plan time and, when a script was edited, at start-up.
"""
from .markers import pipe_split
from .pipeline import Pipeline, register_step_end_hook, register_step_hook

__all__ = ["Pipeline", "pipe_split", "register_step_end_hook", "register_step_hook"]
