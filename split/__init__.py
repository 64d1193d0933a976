"""Step 2 of ``tracepp split`` (imported as ``tracepp.split``: ``pyproject.toml`` maps this folder there).

Dependency direction: ``tracepp.driver`` calls ``tracepp.split.partition.split`` on the trace step's result and
hands the returned ``PipelineGraph`` (plain data, ``pipeline_graph.py``) to ``tracepp.codegen``. This package
imports torch and sympy, nothing of ``tracepp.codegen`` or ``tracepp.runtime`` except the runtime's
``pipe_split`` marker op (the op the user's model calls, which the trace keeps).
"""
