"""tracepp's runtime: what generated rank scripts import. Depends on torch and the standard library only.

The emit step copies this package into every output folder as ``tracepp_runtime``, so a pipeline runs on a
machine that has torch but not tracepp.
"""
from .markers import pipe_split

__all__ = ["pipe_split"]
