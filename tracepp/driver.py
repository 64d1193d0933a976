"""The whole of ``tracepp split``, top to bottom: trace → split → plan → emit.

Each step is one module with one job and hands plain data to the next.
"""
from __future__ import annotations

import shlex
from typing import Optional

from tracepp.codegen.emit import emit
from tracepp.codegen.plan import plan, stages_per_rank
from tracepp.modelfile import load_model_file
from tracepp.split.partition import split
from tracepp.trace import trace


def split_model(model_path: str, out_dir: str, num_ranks: int = 2, num_stages: Optional[int] = None,
                schedule: str = "1f1b", num_microbatches: int = 4, split_points: Optional[list] = None,
                dynamic_shapes=None) -> dict:
    model_file = load_model_file(model_path)                                          # the user's contract
    traced = trace(model_file, num_microbatches, dynamic_shapes)                      # 1. torch.export
    graph = split(traced, split_points or model_file.split_points, num_stages,          # 2. stage graphs
                  default_stages=num_ranks * stages_per_rank(schedule), schedule=schedule,
                  num_microbatches=num_microbatches, training=model_file.training)
    the_plan = plan(graph, schedule, num_ranks, num_microbatches, model_file.training)  # 3. schedule
    launch = f"torchrun --nproc-per-node {num_ranks} {shlex.quote(out_dir.rstrip('/') + '/run.py')}"
    manifest = emit(out_dir, model_file, traced, graph, the_plan, launch)             # 4. output folder
    return manifest
