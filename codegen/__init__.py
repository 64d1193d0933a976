"""Steps 3 and 4 of ``tracepp split`` (imported as ``tracepp.codegen``: ``pyproject.toml`` maps this folder there).

Dependency direction: ``tracepp.driver`` → ``tracepp.split`` (its ``PipelineGraph``) → ``tracepp.codegen`` (plan:
schedules, lowering, validation and simulation on plain action lists; emit: the output folder) →
``tracepp.runtime``, which ``emit`` copies into the output folder and which never imports this package.
"""
