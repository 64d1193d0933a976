"""Run a tracepp output folder's ``run.py`` under torchrun, adding the benchmark's peak-memory measurement.

    torchrun --nproc-per-node R -m benchmarks.tracepp_worker OUT_DIR --memory-dir DIR -- --steps K --metrics m.jsonl --quiet

Everything after ``--`` goes to the generated ``run.py`` unchanged; the step time is the runtime's own
``--metrics`` line (``step_time_s``: ``Pipeline.step`` plus shared-gradient sync and the optimizer step, on the
last stage's rank). The only addition is a step hook registered through the runtime's public
``tracepp_runtime.register_step_hook`` (the copy inside OUT_DIR that run.py imports): it calls
``PeakMemory.at_step`` before every step (the memory window is the last step, untimed by the harness: its
``Pipeline.step``, shared-gradient sync and optimizer step; see benchmarks/memory.py); it costs one Python call
per step and does not touch the timed code. The window closes where run.py's loop ends: at the first of
``--save``/``--save-safetensors`` or the closing barrier (the launch module's ``_save``, ``_save_safetensors`` and
``dist.barrier`` are wrapped to close it first), so that the after-loop gather of ``--save`` is not counted.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from benchmarks.memory import PeakMemory, write_memory


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

    def end_window() -> None:
        """The training loop is over (after the last step's optimizer step): close the memory window before
        what run.py does after its loop (``--save``'s gather, the closing barrier), as the other workers do."""
        memory = state["memory"]
        if memory is not None and memory.marked and "result" not in state:
            state["result"] = memory.stop()

    def ending(function):
        def wrapped(*call_args, **call_kwargs):
            end_window()
            return function(*call_args, **call_kwargs)
        return wrapped

    if args.memory_dir:
        tracepp_runtime.register_step_hook(at_step)
        from tracepp_runtime import launch

        for name in ("_save", "_save_safetensors"):
            setattr(launch, name, ending(getattr(launch, name)))
        launch.dist = _DistAfterLoop(launch.dist, end_window)  # the loop's closing barrier
    sys.argv = [os.path.join(out_dir, "run.py")] + rest
    runpy.run_path(os.path.join(out_dir, "run.py"), run_name="__main__")
    if state["memory"] is not None:
        end_window()
        write_memory(args.memory_dir, int(os.environ.get("RANK", "0")), state["result"])


class _DistAfterLoop:
    """``torch.distributed`` as the runtime's launch module sees it, but ``barrier`` first calls ``before``
    (the runtime's steps never call barrier; run.py's end does)."""

    def __init__(self, module, before):
        self._module, self._before = module, before

    def barrier(self, *args, **kwargs):
        self._before()
        return self._module.barrier(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


if __name__ == "__main__":
    main()
