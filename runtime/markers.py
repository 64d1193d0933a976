"""The ``pipe_split()`` marker: a custom op that ``torch.export`` keeps in the graph.

Calling it inside ``forward`` says "a new pipeline stage begins here". Eagerly it does nothing. It lives in
the runtime (torch only) so a generated output folder can import a model file that calls it even where
tracepp itself is not installed.
"""
import torch

_NAMESPACE = "tracepp"


def _register():
    if hasattr(torch.ops, _NAMESPACE) and hasattr(getattr(torch.ops, _NAMESPACE), "pipe_split"):
        return getattr(torch.ops, _NAMESPACE).pipe_split.default
    lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    lib.define("pipe_split() -> ()")
    lib.impl("pipe_split", lambda: None, "CompositeExplicitAutograd")
    _register.lib = lib  # keep the library alive for the life of the process
    op = torch.ops.tracepp.pipe_split.default
    torch.fx.node.has_side_effect(op)
    return op


PIPE_SPLIT_OP = _register()


def pipe_split() -> None:
    """Mark a stage boundary inside ``forward``: everything traced after this call runs on the next stage."""
    torch.ops.tracepp.pipe_split()
