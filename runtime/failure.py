"""Never a hang: a failing rank tells every other rank, and every rank exits non-zero naming it.

Each rank runs a watchdog thread polling a key in the torchrun rendezvous store. A rank that fails writes
its message there and exits 1; the others see it within a fraction of a second, print who failed and why,
and exit 1 too, even if they are blocked in a receive. A rank whose wait on a stalled peer times out reports
it the same way, naming what it waited for (:func:`stall_message`), so every live rank stops within about
``--timeout``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_FAILED = 1
_POLL_S = 0.2
_JOIN_S = 5.0  # a store call returns in milliseconds; one that does not within this is on a store that is gone


class PipelineError(RuntimeError):
    """An error the user can act on; printed without a traceback."""


def say(rank: int, text: str) -> None:
    """``[tracepp rank N] text`` on stderr as one write: ranks share the pipe, and ``print`` under ``python -u``
    writes the text and its newline separately, so two ranks' lines could interleave into one."""
    sys.stderr.write(f"[tracepp rank {rank}] {text}\n")
    sys.stderr.flush()


def agree(problem, group=None) -> None:
    """Collective over ``group`` (default: every rank): each rank passes the problem it found (a message) or None;
    if any rank found one, every rank raises it (its own, else the lowest rank's, named), so a check that some
    ranks pass and others fail stops every rank with the cause, none first stopped by a faster peer's report."""
    problems = [problem]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    first = next(((rank, text) for rank, text in enumerate(problems) if text), None)
    if first is not None:
        raise PipelineError(problem or f"rank {first[0]}: {first[1]}")


def stall_message(rank: int, timeout_s: float, awaited: str) -> str:
    """What a rank says when a wait on a peer runs out: "rank 0 waited 10 s for the activation of ..."."""
    return (f"rank {rank} waited {timeout_s:g} s for {awaited}: that rank stalled (stopped, hung in "
            f"batch(step) or the data loader, or far slower than the rest); if it is only slow, raise --timeout")


class FailureChannel:
    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.store = None
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.key = f"tracepp/{run_id}/{restart}/failure"
        self.done_key = f"tracepp/{run_id}/{restart}/done{rank}"
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port and world_size > 1:
            self.store = dist.TCPStore(host, int(port), world_size, is_master=False,
                                       timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        self._stop = threading.Event()
        self._thread = None

    def start_watchdog(self) -> None:
        if self.store is None:
            return
        self._thread = threading.Thread(target=self._watch, name="tracepp-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                if self.store.check([self.key]):
                    message = self.store.get(self.key).decode()
                    if not message.startswith(f"rank {self.rank} "):
                        say(self.rank, f"stopping because {message}")
                        os._exit(EXIT_FAILED)
            except Exception:  # the store went away: torchrun is tearing the job down
                pass
            self._stop.wait(_POLL_S)

    def peer_failure(self, wait_s: float = 2.0):
        """The failure another rank reported, waiting briefly for it (our error may be its echo), else None."""
        if self.store is None:
            return None
        deadline = time.time() + wait_s
        while True:
            try:
                if self.store.check([self.key]):
                    message = self.store.get(self.key).decode()
                    return None if message.startswith(f"rank {self.rank} ") else message
            except Exception:
                return None
            if time.time() >= deadline:
                return None
            time.sleep(0.05)

    def report(self, message: str, echo: bool = True) -> None:
        """Tell every rank that this one failed (first failure wins), then the caller exits. ``echo=False``:
        the message was printed already."""
        text = f"rank {self.rank} failed: {message}"
        if self.store is not None:
            try:
                self.store.compare_set(self.key, "", text)
            except Exception:
                pass
        if echo:
            say(self.rank, f"error: {message}")
        if self.store is not None:  # let the others' watchdogs read it before torchrun tears the job down
            time.sleep(2 * _POLL_S)

    def stop(self) -> bool:
        """End the watchdog and wait for it; False if it is still inside a store call after a few seconds.

        The thread must be gone before the interpreter shuts down: a daemon thread that comes back from a store
        call during shutdown is ended inside C++ code, and the process aborts ("terminate called without an
        active exception", SIGABRT) after a run that succeeded. A caller that gets False must leave with
        ``os._exit``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=_JOIN_S)
            if thread.is_alive():
                return False
        self.store = None  # its client closed now, while the interpreter is whole, not in shutdown's teardown
        return True
