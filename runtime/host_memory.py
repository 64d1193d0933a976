"""Host (CPU) memory hygiene for CPU ranks: freed tensor memory goes back to the operating system.

torch's CPU allocator takes its memory from glibc's ``malloc``. glibc raises its mmap threshold each time a
large block is freed (up to 32 MiB), so gradients, weight-gradient temporaries and optimizer state of up to
that size end up in the heap, and the heap keeps what a step freed (activations, temporaries) resident: on a
551M-parameter Llama split over 4 CPU ranks, 0.1 - 0.3 GB per rank stayed resident after the backward, on top
of the AdamW state the optimizer step then allocated (``benchmarks/real_size.py``; README "Real-size
models"). So ``run.py`` on a CPU rank:

* fixes glibc's mmap threshold at 4 MiB (``mallopt(M_MMAP_THRESHOLD)``, which also stops its dynamic
  raising): blocks of 4 MiB or more are mapped on allocation and unmapped on free. Smaller blocks, where
  the tiny models of the test suite and the CPU benchmarks keep their activations, are not affected;
* and its trim threshold at 64 MiB (``M_TRIM_THRESHOLD``). Fixing the mmap threshold also freezes this one at
  glibc's 128 KiB default, so every ``free`` that left more than 128 KiB free at the top of the heap gave it
  back and the next step's allocations faulted it in again: 1400 - 1900 page faults per step per rank in the
  CPU quick suite's interleaved-ZB case, at about 3.7 us each on the project's VM (5 - 7 ms of a 120 - 160 ms
  step); 4 - 6 with it. The heap's free memory is returned below instead, once per step, above the same 64 MiB;
* after each step's backward, before the optimizer allocates or updates anything, calls ``malloc_trim(0)``
  when the heap holds more than 64 MiB of free memory (``mallinfo2``), returning its free pages.

Neither changes a value. ``TRACEPP_HOST_MEMORY=off`` leaves glibc's defaults alone; on a C library other than
glibc (or a GPU rank, whose tensors live in CUDA's allocator) nothing is done. A loop of your own on the
``Pipeline`` API may call :func:`configure` once and :func:`release` after each step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 4 << 20
TRIM_ABOVE = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = None


def _glibc():
    """glibc, when this process runs on it and it has what is needed (``mallinfo2``: glibc 2.33+), else None."""
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") and hasattr(libc, "mallinfo2"):
                libc.mallinfo2.restype = _MallInfo2
                _LIBC = libc
        except OSError:
            pass
    return _LIBC or None


def enabled(device) -> bool:
    return getattr(device, "type", str(device)) == "cpu" and os.environ.get("TRACEPP_HOST_MEMORY", "on") != "off" \
        and _glibc() is not None


def configure(device) -> bool:
    """Fix the mmap and trim thresholds (see the module docstring); True when they were set."""
    if not enabled(device):
        return False
    libc = _glibc()
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_ABOVE))


def free_heap_bytes() -> int:
    libc = _glibc()
    return int(libc.mallinfo2().fordblks) if libc is not None else 0


def release(device) -> bool:
    """Return the heap's free pages to the OS when it holds more than ``TRIM_ABOVE`` free bytes; True if it did."""
    if not enabled(device) or free_heap_bytes() <= TRIM_ABOVE:
        return False
    _glibc().malloc_trim(0)
    return True
