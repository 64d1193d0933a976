"""What the commands print: stage tables (``stages``), the plan's grid, simulation and pictures (``plan``),
and ``tracepp check``'s warnings (``checks``). Reads what the other steps computed; imports nothing above it
(docs/design.md)."""
