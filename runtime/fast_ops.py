"""The stage code's op calls without the Python frame torch puts in front of each.

A rank script calls every op as ``torch.ops.aten.linear.default(x, w, b)``: an ``OpOverload`` object whose
``__call__`` is one line of Python, ``return self._op(*args, **kwargs)``, in front of the C++ callable that enters
torch's dispatcher. On a small microbatch that frame is a fair share of the op: a GPT block's forward on one
32-token sample took 416 us through ``OpOverload.__call__`` and 373 us calling ``_op`` directly (1 CPU thread,
100 calls, interleaved), 10%; forward and backward 4% (the backward runs in autograd's C++ engine either way).

:func:`bind` gives the functions of a rank script a ``torch`` of their own (:class:`FastTorch`): the real module for
everything but ``torch.ops``, where each ``OpOverload`` reached through ``torch.ops.<namespace>.<op>.<overload>``
is its ``_op`` (the same dispatcher entry ``__call__`` calls: modes, subclasses, autograd and custom ops' Python
kernels all run as before), and anything else (packets called without an overload, higher-order operators) is
torch's own object. The script's text is unchanged: it reads as torch's ops, and runs them one frame shorter.
Not used under ``--compile`` (dynamo traces torch's own objects) or with ``TRACEPP_FAST_OPS=off``. Imports torch
only.
"""
from __future__ import annotations

import os
import types

import torch
from torch._ops import OpOverload, OpOverloadPacket


class _Overloads:
    """One op (``torch.ops.aten.linear``): its overloads' C++ callables, looked up once each."""

    def __init__(self, packet: OpOverloadPacket):
        self._packet = packet

    def __getattr__(self, name: str):
        value = getattr(self._packet, name)
        if isinstance(value, OpOverload) and callable(getattr(value, "_op", None)):
            value = value._op
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):  # a packet called without naming its overload: torch resolves it
        return self._packet(*args, **kwargs)


class _Namespace:
    """``torch.ops.<namespace>``: its ops as :class:`_Overloads`, anything else (a higher-order operator) as is."""

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name: str):
        value = getattr(self._namespace, name)
        if isinstance(value, OpOverloadPacket):
            value = _Overloads(value)
        setattr(self, name, value)
        return value


class _Ops:
    """``torch.ops``: namespaces as :class:`_Namespace`, made on first use (ops registered later are found then)."""

    def __getattr__(self, name: str):
        value = _Namespace(getattr(torch.ops, name))
        setattr(self, name, value)
        return value


class FastTorch(types.ModuleType):
    """``torch`` for a rank script's functions: ``ops`` as above, every other name torch's own."""

    def __init__(self):
        super().__init__("torch", torch.__doc__)
        self.ops = _Ops()

    def __getattr__(self, name: str):
        return getattr(torch, name)


_FAST = None


def enabled() -> bool:
    return os.environ.get("TRACEPP_FAST_OPS", "on") != "off"


def bind(function) -> bool:
    """Make the module of ``function`` (a rank script's stage function) see :class:`FastTorch` as ``torch``; True
    if it did (a function without a module-level ``torch``, or with the switch off, is left alone)."""
    global _FAST
    scope = getattr(function, "__globals__", None)
    if not enabled() or scope is None or scope.get("torch") is not torch:
        return isinstance(scope, dict) and isinstance(scope.get("torch"), FastTorch)
    if _FAST is None:
        _FAST = FastTorch()
    scope["torch"] = _FAST
    return True


def unbind(function) -> None:
    """Give ``function``'s module torch's own ``torch`` back (before ``torch.compile`` traces it)."""
    scope = getattr(function, "__globals__", None)
    if isinstance(scope, dict) and isinstance(scope.get("torch"), FastTorch):
        scope["torch"] = torch
