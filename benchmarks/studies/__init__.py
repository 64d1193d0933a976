"""One-off studies: each answered one question, recorded in docs/benchmarks.md; kept to reproduce that answer.

- ``action_costs``: each compute action's time in a run against its stage's plain-autograd cost (where the
  runtime adds time per kind of action).
- ``cpu_bind``: binding each CPU rank to its own cores against leaving the affinity alone, on the quick suite.
- ``cuda_report``: gathers one GPU session's measurements into one JSON and PNG.
- ``dp_sync``: FSDP collectives per step, tracepp's once-per-step layout against reducing every microbatch.
- ``exchange_cost``: what one message costs two computing ranks, gloo against shared-memory rings.
- ``floor_pairs``: tracepp's executor against the floor loop (``benchmarks/floor_worker.py``), step by step in the
  same processes: what tracepp's runtime costs over running the plan with nothing but the stage functions.
- ``gpu_profile_stage``: a stage's kernel time next to the same layers as a plain module (GPU).
- ``rank_script_digests``: digests of the generated programs, to show a refactor leaves them byte-identical.
- ``tp_collectives_forms``: gloo's list forms of all-gather and reduce-scatter against the one-buffer forms.
- ``timeline``: a measured step's time action by action next to the simulator's timeline.
- ``weight_split``: the zero-bubble split backward's (I + W) against one full backward, per stage.
"""
