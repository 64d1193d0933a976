"""The whole of ``tracepp split``, top to bottom: trace → split → plan → emit.

Each step is one module with one job and hands plain data to the next.
"""
from __future__ import annotations

import shlex
from typing import Optional

from tracepp.codegen.emit import build_manifest, emit
from tracepp.codegen.plan import plan, stages_per_rank
from tracepp.modelfile import load_model_file
from tracepp.split.partition import split
from tracepp.trace import trace


def _plan(model_path: str, num_ranks: int, num_stages: Optional[int], schedule: str, num_microbatches: int,
          split_points: Optional[list], dynamic_shapes):
    """Steps 1-3, shared by ``split`` and ``check``: (model file, traced program, stage graphs, plan)."""
    model_file = load_model_file(model_path)                                          # the user's contract
    traced = trace(model_file, num_microbatches, dynamic_shapes, on_meta="auto")      # 1. torch.export (meta if big)
    points = None if split_points == "auto" else (split_points or model_file.split_points)
    graph = split(traced, points, num_stages,                                         # 2. stage graphs
                  default_stages=num_ranks * stages_per_rank(schedule), schedule=schedule,
                  num_microbatches=num_microbatches, training=model_file.training)
    the_plan = plan(graph, schedule, num_ranks, num_microbatches, model_file.training)  # 3. schedule
    return model_file, traced, graph, the_plan


def split_model(model_path: str, out_dir: str, num_ranks: int = 2, num_stages: Optional[int] = None,
                schedule: str = "1f1b", num_microbatches: int = 4, split_points: Optional[list] = None,
                dynamic_shapes=None) -> dict:
    model_file, traced, graph, the_plan = _plan(model_path, num_ranks, num_stages, schedule, num_microbatches,
                                                split_points, dynamic_shapes)
    launch = f"torchrun --nproc-per-node {num_ranks} {shlex.quote(out_dir.rstrip('/') + '/run.py')}"
    manifest = emit(out_dir, model_file, traced, graph, the_plan, launch)             # 4. output folder
    return manifest


def check_model(model_path: str, num_ranks: int = 2, num_stages: Optional[int] = None, schedule: str = "1f1b",
                num_microbatches: int = 4, split_points: Optional[list] = None, dynamic_shapes=None) -> dict:
    """``tracepp check``: trace, split and plan as :func:`split_model` does, and return the manifest unwritten."""
    model_file, traced, graph, the_plan = _plan(model_path, num_ranks, num_stages, schedule, num_microbatches,
                                                split_points, dynamic_shapes)
    return build_manifest(model_file, traced, graph, the_plan, f"torchrun --nproc-per-node {num_ranks} out/run.py")
