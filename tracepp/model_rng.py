"""Does ``model()`` build the same model every time it is called?

Every rank of a job calls the model file's ``model()`` for its own weights (``--init model``), and a tensor-parallel
group's ranks cut their shards from the tensors each of them built. ``torch.manual_seed`` in ``model()`` makes torch's
draws repeat; a draw from Python's ``random`` or numpy's global generator that ``model()`` does not seed differs from
process to process (hyper-connections picks each block's initial residual stream with ``random.randrange``:
recurrent-memory-transformer's ranks built different weights, and the split trained to parameters 1.0 away from
eager, with no warning). Where tracepp builds the model anyway, the build's draws from both generators are watched;
where it made any, the model is built again from two other generator states and the two compared, tensor by tensor
(a draw that picks no weight, beartype's sampling of a container to check, is no difference). A model too large to
build for real is built on meta only: its draws are named in a note.
"""
from __future__ import annotations

import random
from typing import Callable


def _numpy():
    try:
        import numpy
    except ImportError:  # the runtime needs only torch; without numpy there is no numpy generator to watch
        return None
    return numpy


def _seed(value: int) -> None:
    random.seed(value)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(value)


def _state():
    numpy = _numpy()
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def _same_state(a, b) -> bool:
    (py_a, np_a), (py_b, np_b) = a, b
    if py_a != py_b:
        return False
    if np_a is None or np_b is None:
        return np_a is np_b
    return np_a[0] == np_b[0] and bool((np_a[1] == np_b[1]).all()) and tuple(np_a[2:]) == tuple(np_b[2:])


def draws(build: Callable) -> tuple:
    """``(what build() returns, whether it drew from Python's random or numpy's global generator)``; the callers'
    generator states are restored."""
    saved = _state()
    try:
        _seed(1234)
        start = _state()
        result = build()
        return result, not _same_state(_state(), start)
    finally:
        _restore(saved)


def _restore(saved) -> None:
    random.setstate(saved[0])
    numpy = _numpy()
    if numpy is not None and saved[1] is not None:
        numpy.random.set_state(saved[1])


def differs(build: Callable, path: str):
    """Why ``model()`` (``build``, for real) builds other tensors from other generator states, or None."""
    import torch

    saved = _state()
    try:
        models = []
        for seed in (1234, 4321):
            _seed(seed)
            built = build()
            models.append({k: v for k, v in built.state_dict().items() if isinstance(v, torch.Tensor)})
    finally:
        _restore(saved)
    first, second = models
    changed = sorted(k for k in first if k not in second or first[k].shape != second[k].shape
                     or not torch.equal(first[k], second[k]))
    if not changed and set(first) == set(second):
        return None
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return (f"model() in {path} builds other weights ({shown}) from other states of Python's random or numpy's "
            f"global generator, which it draws from without seeding (a library picking a value at random while it "
            f"builds: hyper-connections' random.randrange): every rank calls model() for its own weights, and each "
            f"would build different ones. Seed them in model(), beside torch.manual_seed: random.seed(0) (and "
            f"numpy.random.seed(0))")


def note(path: str) -> str:
    return (f"model() in {path} draws from Python's random or numpy's global generator, which it does not seed; the "
            f"model is too large to build twice here and compare: if those draws pick weights, every rank would build "
            f"different ones (seed them in model(): random.seed(0))")
