"""CPU ranks: each local rank runs on cores of its own.

Several ranks of one machine share its cores. Left alone, the scheduler moves each rank's threads (its compute
thread, gloo's communication threads) from core to core: a rank's working set leaves the core's L2 cache, and
its compute thread is preempted by another rank's gloo threads. So ``run.py`` on a CPU rank binds its process,
before the process group (and with it gloo's threads) starts, to an equal share of the cores the process may
use: local rank ``r`` of ``L`` gets the ``n = len(allowed) // L`` cores ``allowed[r*n:(r+1)*n]`` (sorted).
With more local ranks than cores nothing is bound (no share would be whole). Should torch's intra-op thread
count (``OMP_NUM_THREADS``, 1 per rank under torchrun) exceed the share, it is lowered to the share's size.

Binding changes no value (a lowered thread count may reorder a parallel reduction, as any thread count
does). On 2 cores, 2 ranks of the quick benchmark's cases took 0.80 - 1.01 times the step time
bound that they took unbound: 0.80 and 0.82 in interleaved 1F1B, within 6% either way in the other cases
(``benchmarks/studies/cpu_bind.py``, two runs; README "Benchmarks"). ``run.py --cpu-bind none`` leaves the
affinity alone, e.g. where a launcher (``numactl``, ``taskset``) already bound each rank. Two jobs on one
machine should each start under ``taskset -c`` with cores of their own (the shares are cut from the cores the
process may use) or both pass ``none``: bound alike, they would share the same first cores. GPU ranks are not
bound. A loop of your own on the ``Pipeline`` API may call :func:`bind` before creating its ``Pipeline``.
"""
from __future__ import annotations

import os

import torch

MODES = ("auto", "none")
_bound = None  # the cores bind() gave this process


def cores_for(local_rank: int, local_world: int, allowed) -> list | None:
    """This local rank's share of ``allowed`` (core ids), or None when there are fewer cores than local ranks."""
    cores = sorted(allowed)
    share = len(cores) // local_world if local_world > 0 else 0
    if share < 1 or not 0 <= local_rank < local_world:
        return None
    return cores[local_rank * share:(local_rank + 1) * share]


def bind(mode: str = "auto") -> list | None:
    """Bind this process to its local rank's share of its allowed cores (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``,
    as torchrun sets them); returns the cores, or None where nothing was bound (``mode`` "none", one local rank,
    more local ranks than cores, a platform without ``sched_setaffinity``, or one that refuses it)."""
    if mode not in MODES:
        raise ValueError(f"cpu binding {mode!r}: expected one of {', '.join(MODES)}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if mode == "none" or local_world < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = cores_for(int(os.environ.get("LOCAL_RANK", "0")), local_world, os.sched_getaffinity(0))
    if cores is None:
        return None
    try:
        os.sched_setaffinity(0, cores)  # this thread; threads started later inherit its cores
    except OSError:  # a sandbox that forbids it: run unbound, as before binding existed
        return None
    for thread in _threads():  # threads started before (a watchdog, a thread pool) move too
        try:
            os.sched_setaffinity(thread, cores)
        except OSError:  # the thread has ended since it was listed
            pass
    if torch.get_num_threads() > len(cores):
        torch.set_num_threads(len(cores))
    global _bound
    _bound = cores
    return cores


def has_own_core() -> bool:
    """Whether this rank may count on a core no other local rank runs on: :func:`bind` bound it, or there are no
    more local ranks than the cores it may use. A rank that waits on a peer may then poll instead of sleeping."""
    if _bound:
        return True
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= allowed


def _threads() -> list:
    """This process's thread ids (Linux ``/proc``), or [0] (the calling thread) where they cannot be listed."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
