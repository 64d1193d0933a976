"""What a job left running needs around the training loop: a requested stop, progress lines, TensorBoard, and
``run.py`` as its own launcher.

- :class:`StopRequest`: SIGTERM (what a cluster sends before preemption) or SIGUSR1 (what SLURM sends with
  ``--signal=USR1@120``) sets a flag; the ranks agree on it at the end of a step (one number riding on the
  gradient-norm all-reduce, or :func:`any_rank`), then every rank saves the same checkpoint and exits 0.
- :class:`Progress`: elapsed time, tokens/s and the ETA of the per-step console line.
- :class:`Board`: ``--tensorboard DIR`` through torch's ``SummaryWriter`` (the ``tensorboard`` package is an
  optional extra, checked at start-up).
- :func:`launcher`: ``python out/run.py --nproc-per-node N [torchrun options] -- [run.py options]`` starts
  torchrun's launcher in this process and turns a SIGTERM/SIGINT into a quiet exit (torchrun itself prints a
  traceback for a signal it forwards).
"""
from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

from .failure import PipelineError

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopRequest:
    """A stop asked for by a signal to this process; ``requested`` is the signal's name, or None."""

    def __init__(self):
        self.requested = None
        self._previous = {}

    def install(self) -> "StopRequest":
        for name in STOP_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number, _frame) -> None:
        self.requested = signal.Signals(number).name

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous = {}


def any_rank(flag: bool, device) -> bool:
    """True on every rank if ``flag`` is true on any (one all-reduce of one number; the flag itself without a
    process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def clock(seconds: float) -> str:
    """``3725.2`` -> ``1:02:05``."""
    seconds = int(round(max(seconds, 0.0)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Elapsed time since the job (or this restart) started, and the ETA from the median of recent steps."""

    def __init__(self, last_step: int, window: int = 20):
        self.start = time.perf_counter()
        self.last_step, self.window = last_step, window
        self.times = []

    def record(self, seconds: float) -> None:
        self.times.append(seconds)
        del self.times[:-self.window]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, steps_done: int) -> float:
        if not self.times:
            return 0.0
        typical = sorted(self.times)[len(self.times) // 2]
        return typical * max(self.last_step - steps_done, 0)


class Board:
    """``--tensorboard DIR``: scalars written by the reporting rank (the last pipeline rank of the first replica)."""

    def __init__(self, directory: str, purge_step=None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise PipelineError(_tensorboard_missing(directory, error)) from error
        # a resumed run rewrites the steps after its checkpoint: purge_step drops the old run's later events
        self.writer = SummaryWriter(log_dir=directory, purge_step=purge_step)

    def scalars(self, step: int, values: dict) -> None:
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def check_tensorboard(directory) -> None:
    """Fail at start-up, on every rank, when ``--tensorboard`` is asked for without the package."""
    if directory is None:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError as error:
        error_ = PipelineError(_tensorboard_missing(directory, error))
        error_.every_rank_agrees = True
        raise error_ from error


def _tensorboard_missing(directory: str, error: ImportError) -> str:
    return (f"--tensorboard {directory} needs the tensorboard package ({error}): pip install tensorboard (or pip "
            f"install 'tracepp[tensorboard]')")


def launcher(folder: str, argv: list) -> None:
    """``python run.py --nproc-per-node N [torchrun options] -- [run.py options]``: torchrun's launcher in this
    process, ``run.py`` as the workers' script. A SIGTERM/SIGINT to this process goes to every rank (which saves
    and stops) and ends this process with the ranks' exit status, without torchrun's traceback."""
    import os

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    if "--" in argv:
        cut = argv.index("--")
        launcher_args, script_args = argv[:cut], argv[cut + 1:]
    else:
        launcher_args, script_args = argv, []
    options = get_args_parser().parse_args([*launcher_args, os.path.join(folder, "run.py"), *script_args])
    try:
        run(options)
    except SignalException as error:
        sys.stderr.write(f"[tracepp] launcher stopped by {signal.Signals(error.sigval).name}; the ranks were told "
                         f"to save and stop\n")
        sys.exit(128 + int(error.sigval))
    except Exception as error:  # torchrun's ChildFailedError: the ranks printed their own errors
        if type(error).__name__ == "ChildFailedError":
            sys.exit(1)
        raise
