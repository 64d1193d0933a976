"""Work a split spreads over this machine's CPUs: forked processes that inherit what the split holds (the stage
graphs, the plan) and hand plain data back. The memory counts (``codegen.memory``) and the rank scripts
(``codegen.emit``) run here when they are large enough to be worth a fork."""
from __future__ import annotations

import os

# the work worth a fork: the nodes of the stage graphs involved (a 7B Llama's stages of 8 layers hold about 2,000
# each; the tests' models a few hundred)
PARALLEL_NODES = 1500
_TASK = None  # (function, items) the forked workers run (set before the pool forks)


def workers_for(jobs: int, nodes: int) -> int:
    """How many processes share ``jobs`` pieces of work over ``nodes`` graph nodes in all: this machine's CPUs
    (``TRACEPP_PLAN_WORKERS`` sets it; 1 runs everything in this process), where the work is worth a fork."""
    setting = os.environ.get("TRACEPP_PLAN_WORKERS")
    if setting is not None:
        return max(1, min(int(setting), jobs))
    if jobs < 2 or nodes < PARALLEL_NODES or not hasattr(os, "fork"):
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, jobs, 8))


def _run(index: int):
    import torch

    torch.set_num_threads(1)
    function, items = _TASK
    return function(items[index])


def forked_map(function, items: list, workers: int, weight=None) -> list:
    """``[function(item) for item in items]`` computed by ``workers`` forked processes, the heaviest items first
    (``weight(item)``), each result pickled back. Where the pool cannot start (no fork, a worker that dies) the
    caller gets an exception and may run the items itself."""
    import multiprocessing

    global _TASK
    order = sorted(range(len(items)), key=lambda i: -weight(items[i])) if weight else list(range(len(items)))
    _TASK = (function, items)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_run, order, chunksize=1)
    finally:
        _TASK = None
    found = [None] * len(items)
    for position, result in zip(order, results):
        found[position] = result
    return found
