"""The cost model: what a plan costs in seconds on this machine, and the search for a cheaper plan.

- ``measure_stages``: each stage's F, B, I, W with plain autograd (and through tracepp's executor).
- ``measure_in_run``: the same, timed by a run's own ranks between its steps (paired with each step).
- ``measure_comm``: ping-pong between ranks: latency and bandwidth per pair (``python -m tracepp.costs.measure_comm``).
- ``costs_file``: the ``--costs`` JSON files.
- ``model``: the fitted model (``calibration.json``): runtime factors, overheads, predicting a plan's step.
- ``calibrate``: ``tracepp calibrate``: measure, fit, write ``calibration.json``.
- ``search``: ``tracepp plan --tune``: candidate plans priced by the model; the CLI applies the choice.

Depends on the runtime, split and codegen; nothing below imports it (docs/design.md).
"""
