"""Where planning's time and memory go: the driver's steps timed one by one (``tracepp split --timings``,
``benchmarks/plan_time.py``).

    with phases.step("trace"):
        traced = trace(...)

Each step records its wall time, the CPU time of this process and its finished worker processes, the resident set at its end and the process's
peak resident set so far (``ru_maxrss``, a high-water mark: a step's own peak is the first step whose figure
rose). Recording is always on and costs two clock reads per step; :func:`taken` hands the list over and starts a
new one.
"""
from __future__ import annotations

import contextlib
import os
import resource
import sys
import time

_recorded: list = []


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _cpu_s() -> float:
    """CPU seconds of this process and of the worker processes it has waited for (the memory count's)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@contextlib.contextmanager
def step(name: str):
    """Time the block as the step ``name``; nested steps are recorded as ``outer/inner``."""
    stack = [entry["name"] for entry in _recorded if entry.get("_open")]
    full = "/".join(stack + [name])
    entry = {"name": full, "_open": True}
    _recorded.append(entry)
    wall, cpu = time.perf_counter(), _cpu_s()
    try:
        yield entry
    finally:
        entry.pop("_open", None)
        entry.update(wall_s=round(time.perf_counter() - wall, 3), cpu_s=round(_cpu_s() - cpu, 3),
                     rss_bytes=_rss_bytes(), peak_rss_bytes=_peak_rss_bytes())


def taken() -> list:
    """The steps recorded since the last call (in the order they began), and a fresh record."""
    global _recorded
    done, _recorded = [e for e in _recorded if "_open" not in e], [e for e in _recorded if "_open" in e]
    return done


def table(steps: list) -> str:
    """The steps as a text table: wall s, CPU s, resident at the end and the peak so far, in GB."""
    lines = [f"{'step':<28} {'wall s':>8} {'cpu s':>8} {'rss GB':>8} {'peak GB':>8}"]
    for entry in steps:
        lines.append(f"{entry['name']:<28} {entry['wall_s']:>8.2f} {entry['cpu_s']:>8.2f} "
                     f"{entry['rss_bytes'] / 1e9:>8.2f} {entry['peak_rss_bytes'] / 1e9:>8.2f}")
    return "\n".join(lines)
