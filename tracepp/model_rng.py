"""Does ``model()`` build the same model every time it is called?

Every rank of a job calls the model file's ``model()`` for its own weights (``--init model``), and a tensor-parallel
group's ranks cut their shards from the tensors each of them built. ``torch.manual_seed`` in ``model()`` makes torch's
draws repeat; a draw from Python's ``random`` or numpy's global generator that ``model()`` does not seed differs from
process to process (hyper-connections picks each block's initial residual stream with ``random.randrange``:
recurrent-memory-transformer's ranks built different weights, and the split trained to parameters 1.0 away from
eager, with no warning). Checked where tracepp builds the model anyway: the build's draws from both generators are
watched, and where it made any, ``model()`` is called again from other generator states; different draws are refused
by name.
"""
from __future__ import annotations

import random
from typing import Callable


def _states():
    try:
        import numpy
    except ImportError:  # the runtime needs only torch; without numpy there is no numpy generator to watch
        numpy = None
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None), numpy


def _np_same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])


def built_alike(build: Callable, path: str) -> tuple:
    """``(what build() returns, None)``, or ``(it, why)`` where ``model()`` draws from Python's ``random`` or numpy's
    global generator without seeding it: called from two generator states, its draws differ. The callers' generator
    states are restored."""
    saved_py, saved_np, numpy = _states()
    try:
        random.seed(1234)
        if numpy is not None:
            numpy.random.seed(1234)
        start_py, start_np, _ = _states()
        result = build()
        first_py, first_np, _ = _states()
        drew_py = first_py != start_py
        drew_np = numpy is not None and not _np_same(first_np, start_np)
        if not (drew_py or drew_np):
            return result, None
        random.seed(4321)
        if numpy is not None:
            numpy.random.seed(4321)
        build()
        second_py, second_np, _ = _states()
        random.seed(1234)
        if numpy is not None:
            numpy.random.seed(1234)
        same_py = second_py == first_py  # seeded inside model(): the same draws from either start
        same_np = numpy is None or _np_same(second_np, first_np)
        which = [name for name, drew, same in (("Python's random", drew_py, same_py),
                                                ("numpy's global generator", drew_np, same_np)) if drew and not same]
        if not which:
            return result, None
        return result, (f"model() in {path} draws from {' and '.join(which)} without seeding it (a library picking "
                        f"a value at random while it builds: hyper-connections' random.randrange): every rank calls "
                        f"model() for its own weights, and each would build different ones. Seed it in model(), "
                        f"beside torch.manual_seed: random.seed(0)" + (", numpy.random.seed(0)"
                                                                        if "numpy's global generator" in which else ""))
    finally:
        random.setstate(saved_py)
        if numpy is not None and saved_np is not None:
            numpy.random.set_state(saved_np)
