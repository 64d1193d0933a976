"""Run a tracepp output folder's ``run.py`` under torchrun, adding the benchmark's peak-memory measurement.

    torchrun --nproc-per-node R -m benchmarks.tracepp_worker OUT_DIR --memory-dir DIR -- --steps K --metrics m.jsonl --quiet

Everything after ``--`` goes to the generated ``run.py`` unchanged; the step time is the runtime's own
``--metrics`` line (``step_time_s``: ``Pipeline.step`` plus shared-gradient sync and the optimizer step, on the
last stage's rank). The only additions are two hooks registered through the runtime's public API (the copy
inside OUT_DIR that run.py imports): ``tracepp_runtime.register_step_hook`` calls ``PeakMemory.at_step``
before every step (the memory window is the last step, untimed by the harness: its ``Pipeline.step``,
shared-gradient sync and optimizer step; see benchmarks/memory.py), and ``register_step_end_hook`` closes the
window when the last step ends, so nothing run.py does after its loop (``--save``'s gather) is counted. Each
costs one Python call per step and neither touches the timed code.

``--paired-steps P --paired-from S --paired-costs PREFIX`` (CPU suites): ``tracepp.costs.measure_in_run``' in-run stage
costs: after step ``S - 1`` and after each of the ``P`` steps from ``S`` on, every rank times its own stages with
plain autograd, all ranks at once between two barriers, in the step-end hook after the step's timing; each rank
writes ``PREFIX.rank<r>.json``. ``benchmarks/run.py`` prices the schedule's ideal and checks the calibrated
simulator per paired step with them. Steps before ``S`` are not touched.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from benchmarks.memory import PeakMemory, write_memory
from tracepp.costs.measure_in_run import PairedCosts


def main() -> None:
    argv = sys.argv[1:]
    rest = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--memory-dir", default=None)
    parser.add_argument("--cpu-from-step", type=int, default=None,
                        help="also record CPU time per step from this step to the memory window (memory.py)")
    parser.add_argument("--paired-steps", type=int, default=0,
                        help="steps bracketed by in-run plain-autograd stage costs (see the module docstring)")
    parser.add_argument("--paired-from", type=int, default=None, help="the first of those steps")
    parser.add_argument("--paired-costs", default=None, help="PREFIX of the per-rank JSON files of those costs")
    args = parser.parse_args(argv)
    out_dir = os.path.abspath(args.out_dir)
    sys.path.insert(0, out_dir)
    import tracepp_runtime  # the runtime copy that run.py imports

    steps_parser = argparse.ArgumentParser(add_help=False)
    steps_parser.add_argument("--steps", type=int, default=3)  # run.py's own default
    steps = steps_parser.parse_known_args(rest)[0].steps
    state = {"memory": None}

    def at_step(pipeline, step: int) -> None:
        if state["memory"] is None:
            state["memory"] = PeakMemory(pipeline.device, cpu_from_step=args.cpu_from_step)
        state["memory"].at_step(step, steps)

    def at_step_end(pipeline, step: int) -> None:
        """The last step is over (after its optimizer step): close the memory window before what run.py does
        after its loop (``--save``'s gather, the closing barrier), as the other workers do."""
        memory = state["memory"]
        if step + 1 == steps and memory is not None and memory.marked and "result" not in state:
            state["result"] = memory.stop()

    if args.memory_dir:
        tracepp_runtime.register_step_hook(at_step)
        tracepp_runtime.register_step_end_hook(at_step_end)
    if args.paired_steps > 0:
        if args.paired_from is None or not args.paired_costs:
            parser.error("--paired-steps needs --paired-from and --paired-costs")
        paired = PairedCosts(out_dir, args.paired_from, args.paired_steps, os.path.abspath(args.paired_costs),
                             int(os.environ.get("RANK", "0")))
        paired.register(tracepp_runtime)
    sys.argv = [os.path.join(out_dir, "run.py")] + rest
    runpy.run_path(os.path.join(out_dir, "run.py"), run_name="__main__")
    if state["memory"] is not None:
        if "result" not in state:  # a run whose last step did not end in the loop (none so far): close it here
            state["result"] = state["memory"].stop()
        write_memory(args.memory_dir, int(os.environ.get("RANK", "0")), state["result"])


if __name__ == "__main__":
    main()
