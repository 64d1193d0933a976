"""Peak memory of one training step, measured the same way in every benchmark worker, on every rank.

Every run ends with ``MEMORY_STEPS`` (2) untimed steps after its timed ones: a lead-in step and the measured
step. The harness drops their step times (``benchmarks/run.py``), so no profiling overhead ever reaches a
reported step time. A worker calls :meth:`PeakMemory.at_step` at the start of every step (before the step's
first op: tracepp's ``Pipeline.step``, torch's ``schedule.step``, eager's forward) and
:meth:`PeakMemory.stop` after the last step's optimizer step.

* CPU (primary, ``peak_mb``): the analog of ``torch.cuda.max_memory_allocated`` for torch's CPU allocator.
  ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` runs over the lead-in and the measured
  step; its ``[memory]`` events (bytes allocated > 0 / freed < 0, with timestamps) are sorted by time and
  summed; the result is the running sum's maximum inside the measured step minus its value at the measured
  step's start (a ``record_function`` marker), i.e. the peak of live bytes the step adds on top of what was
  live when it began. The profiler only knows the size of blocks allocated while it is on, so frees of
  older blocks are invisible; the lead-in step is profiled so that everything the previous step leaves for
  the measured one to free is known. Only allocations through torch's CPU allocator on threads that carry
  the profiler state (the main thread and autograd's) are seen; allocations by gloo's or MKL's own code
  are not.
* CPU (secondary, ``rss_growth_mb``): growth of the resident set over the timed steps (the kernel's
  high-water mark ``VmHWM`` reset to the current RSS at the first step via ``echo 5 > /proc/self/clear_refs``,
  read before the profiler starts, minus ``VmRSS`` at the first step). It mixes in glibc's retained free
  memory and one-off allocations, so differences of a few MB are noise. Where clear_refs is not writable it
  is ``ru_maxrss`` growth, a lower bound.
* CPU, alongside: ``comm_ops``, how many of each ``c10d::`` op (collective or point-to-point) the measured step
  issued, from the same profile (a count, not a time), and ``comm_bytes``, the bytes of the ops over plain
  tensors (FSDP's all-gathers and reduce-scatters; :func:`comm_bytes`).
* With ``cpu_from_step=K`` (the first timed step): ``cpu_s_per_step``, this process's CPU time (all its threads:
  ``time.process_time``) per step from step K's start to the memory window's, and ``wall_s_per_step`` over the
  same steps. On a machine shared with other jobs the CPU time is the steadier measure of the work a rank does;
  gloo's waits do not spin (a rank blocked 3 s in recv or all_reduce used under 10 ms of CPU), so it is the
  work done, not the waiting.
* CUDA: ``torch.cuda.max_memory_allocated`` over the measured step (peak stats reset at its start),
  absolute: weights, gradients, optimizer state and activations held by the caching allocator.
"""
from __future__ import annotations

import json
import os
import resource
import time

import torch

MEMORY_STEPS = 2  # untimed steps at the end of every run: lead-in + measured memory step
MARKER = "benchmarks::memory_window"
CPU_METHOD = ("cpu: peak live bytes of torch's CPU allocator during one whole untimed training step after the "
              "timed ones, relative to the live bytes at its start (torch.profiler profile_memory [memory] "
              "events, running sum's max; the previous step is profiled too so its frees are known)")
CUDA_METHOD = "cuda: torch.cuda.max_memory_allocated during one untimed training step after the timed ones"
RSS_METHOD = "cpu rss: peak RSS growth over the timed steps (VmHWM reset via /proc/self/clear_refs)"
RSS_FALLBACK = "cpu rss: ru_maxrss growth over the timed steps (lower bound)"


def _status_kb(field: str):
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memory_events(kineto_results) -> list:
    """``(time_ns, bytes)`` of the CPU allocator's ``[memory]`` events (allocations > 0, frees < 0), by time."""
    found = []
    for event in kineto_results.events():
        if event.name() == "[memory]" and str(event.device_type()).endswith("CPU"):
            found.append((event.start_ns(), int(event.nbytes())))
    found.sort(key=lambda item: item[0])  # stable: same-time events keep the order they were recorded in
    return found


def marker_ns(kineto_results, name: str = MARKER):
    times = [event.start_ns() for event in kineto_results.events() if event.name() == name]
    return min(times) if times else None


def comm_ops(kineto_results, start_ns) -> dict:
    """How many times each ``c10d::`` op (collectives and point-to-point, as the dispatcher names them:
    ``c10d::allreduce_``, ``c10d::send``, ...) was issued from ``start_ns`` on: a count per op, not a time."""
    counts: dict = {}
    for event in kineto_results.events():
        if event.name().startswith("c10d::") and event.start_ns() >= start_ns:
            counts[event.name()] = counts.get(event.name(), 0) + 1
    return dict(sorted(counts.items()))


_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
                "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


def comm_bytes(kineto_results, start_ns) -> dict:
    """Bytes each ``c10d::`` op that takes plain tensors moved from ``start_ns`` on (needs ``record_shapes``): per
    op, the sum of the largest tensor argument of each call (an all-gather's gathered output, a reduce-scatter's
    unreduced input), in that tensor's dtype: what FSDP's collectives carry. Ops over tensor lists are left out."""
    totals: dict = {}
    for event in kineto_results.events():
        if not event.name().startswith("c10d::") or event.start_ns() < start_ns:
            continue
        sizes = []
        for shape, dtype in zip(event.shapes(), event.dtypes()):
            if shape and dtype in _DTYPE_BYTES:
                numel = 1
                for dim in shape:
                    numel *= dim
                sizes.append(numel * _DTYPE_BYTES[dtype])
        if sizes:
            totals[event.name()] = totals.get(event.name(), 0) + max(sizes)
    return dict(sorted(totals.items()))


def peak_growth_bytes(events: list, start_ns=None) -> tuple:
    """Running sum of ``events`` (``(time_ns, bytes)``, sorted): ``(max inside [start_ns, end] minus the
    sum at start_ns, floored at 0; the sum at start_ns)``. ``start_ns=None``: from the first event."""
    running, base, peak = 0, 0, 0
    for time_ns, nbytes in events:
        if start_ns is not None and time_ns < start_ns:
            running += nbytes
            base = peak = running
            continue
        running += nbytes
        peak = max(peak, running)
    return max(0, peak - base), base


class PeakMemory:
    """See the module docstring. ``at_step(step, steps)`` at the start of every step, ``stop()`` after the last."""

    def __init__(self, device: torch.device, cpu_from_step=None):
        self.device = torch.device(device)
        self.cpu_from_step = cpu_from_step  # the timed steps' first; None: no CPU-time reading
        self.cpu_start = self.cpu_s_per_step = self.wall_s_per_step = None
        self.method = CUDA_METHOD if self.device.type == "cuda" else CPU_METHOD
        self.rss_method = None
        self.rss_base_kb = None
        self.rss_growth_mb = None
        self.profiler = None
        self.marked = False

    def at_step(self, step: int, steps: int) -> None:
        if step == 0:
            self._rss_start()
        if step == self.cpu_from_step:
            self.cpu_start = (time.process_time(), time.perf_counter(), step)
        if step == max(0, steps - MEMORY_STEPS):
            if self.cpu_start is not None and step > self.cpu_start[2]:
                cpu, wall, first = self.cpu_start
                self.cpu_s_per_step = (time.process_time() - cpu) / (step - first)
                self.wall_s_per_step = (time.perf_counter() - wall) / (step - first)
            self._rss_read()
            self._profile_start()
        if step == steps - 1:
            self._mark()

    def _rss_start(self) -> None:
        if self.device.type == "cuda":
            return
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.rss_method = RSS_METHOD
        except OSError:
            self.rss_method = RSS_FALLBACK
        self.rss_base_kb = _status_kb("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def _rss_read(self) -> None:
        if self.rss_base_kb is None:
            return
        peak_kb = _status_kb("VmHWM") if self.rss_method == RSS_METHOD else None
        if peak_kb is None:
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.rss_growth_mb = max(0, peak_kb - self.rss_base_kb) / 1024

    def _profile_start(self) -> None:
        if self.device.type == "cuda":
            return
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        self.profiler.start()

    def _mark(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(MARKER):
                pass
        self.marked = True

    def stop(self) -> dict:
        cpu = {} if self.cpu_s_per_step is None else {"cpu_s_per_step": self.cpu_s_per_step,
                                                      "wall_s_per_step": self.wall_s_per_step}
        if not self.marked:
            return {"peak_mb": None, "method": self.method, **cpu}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return {"peak_mb": torch.cuda.max_memory_allocated(self.device) / 2**20, "method": self.method, **cpu}
        self.profiler.stop()
        results = self.profiler.profiler.kineto_results
        events = memory_events(results)
        start = marker_ns(results)
        if start is None:
            raise RuntimeError(f"memory window marker {MARKER!r} missing from the profile")
        peak, base = peak_growth_bytes(events, start)
        return {"peak_mb": peak / 2**20, "method": self.method, "profiled_live_mb_at_start": base / 2**20,
                "memory_events": len(events), "rss_growth_mb": self.rss_growth_mb, "rss_method": self.rss_method,
                "comm_ops": comm_ops(results, start), "comm_bytes": comm_bytes(results, start), **cpu}


def write_memory(directory: str, rank: int, result: dict) -> None:
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"mem_rank{rank}.json"), "w") as handle:
        json.dump(dict(result, rank=rank), handle)


def read_memory(directory: str) -> list:
    """Per-rank results written by :func:`write_memory`, sorted by rank."""
    found = []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            if name.startswith("mem_rank") and name.endswith(".json"):
                with open(os.path.join(directory, name)) as handle:
                    found.append(json.load(handle))
    return sorted(found, key=lambda r: r["rank"])


def cuda_device_or_die() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}). Run on a GPU machine, or use --device cpu.")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
