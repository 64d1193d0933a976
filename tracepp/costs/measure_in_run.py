"""Stage costs measured inside a run, between its steps: each step priced with costs taken a second before and after it.

    torchrun --nproc-per-node R -m tracepp.costs.measure_in_run OUT --paired-from S --paired-steps P --prefix PREFIX \
        -- --steps K --metrics m.jsonl --quiet

Runs the folder's ``run.py`` (everything after ``--`` goes to it unchanged). After step ``S - 1`` and after each
of the ``P`` steps from ``S`` on, every rank times its own stages with plain autograd
(:class:`tracepp.costs.measure_stages.StageCostMeter`: F, B, I, W = B - I; no executor), all ranks at once between two
barriers, in the runtime's step-end hook, after the step's timing; each rank writes its rounds to
``PREFIX.rank<r>.json``. The meter is built before the first step (its copy of the stages and its warm-up round
in the heap before the run settles; built later, it cost the next steps 150 - 1,500 page faults and up to 15%).

Why: a shared machine's speed moves 10 - 40% within minutes. A step time and stage costs measured minutes apart
see different machines, so neither an ideal (the plan simulated with the costs) nor a fitted overhead can be
told from that drift. Priced with the costs its own ranks measured around it, under the same load, a step is
compared with the same machine. :func:`read_paired` gathers the ranks' files and :func:`bracketed` pairs each
step with its costs; ``tracepp calibrate`` fits its overhead per paired step, ``benchmarks/run.py`` prices its
ideal and checks its predictions per paired step.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys


class PairedCosts:
    """The in-run stage-cost rounds (see the module docstring), as ``register_step_hook``/``register_step_end_hook``
    callbacks. Every rank takes part in every barrier whatever its meter does, so a meter that fails (its error is
    written to the file) cannot hang the run."""

    def __init__(self, out_dir: str, first: int, count: int, prefix: str, rank: int):
        self.out_dir, self.first, self.count, self.rank = out_dir, first, count, rank
        self.path = f"{prefix}.rank{rank}.json"
        self.meter, self.rounds, self.error = None, [], None

    def at_step(self, pipeline, step: int) -> None:
        """Before the first (warm-up) step: build the meter (see the module docstring)."""
        if step != 0 or self.meter is not None or self.error is not None:
            return
        try:
            from tracepp.costs.measure_stages import StageCostMeter

            self.meter = StageCostMeter(self.out_dir, device=pipeline.device, precision=pipeline.precision,
                                        stages=pipeline.stage_indices, naive_weight=False)
        except Exception as error:  # reported in the file; the run goes on
            self.error = f"{type(error).__name__}: {error}"

    def at_step_end(self, pipeline, step: int) -> None:
        if not self.first - 1 <= step < self.first + self.count:
            return
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            dist.barrier()  # every rank measures at once, as every rank computes during a step
        costs = None
        if self.meter is not None:
            try:
                self.meter.samples.clear()
                self.meter.run_round()
                costs = self.meter.result()["costs"]
            except Exception as error:
                self.error, self.meter = f"{type(error).__name__}: {error}", None
        self.rounds.append({"after_step": step, "costs": costs})
        if distributed:
            dist.barrier()  # the next step starts on every rank together, none still measuring
        if step == self.first + self.count - 1:
            self.meter = None  # its copy of the stages goes before whatever the run does next
            with open(self.path, "w") as handle:
                json.dump({"rank": self.rank, "stages": list(pipeline.stage_indices), "rounds": self.rounds,
                           "error": self.error}, handle)

    def register(self, runtime) -> None:
        """Hook into ``runtime`` (the ``tracepp_runtime`` copy that the folder's run.py imports)."""
        runtime.register_step_hook(self.at_step)
        runtime.register_step_end_hook(self.at_step_end)


def read_paired(prefix: str, ranks: int, num_stages: int, step_times: list) -> dict:
    """The ranks' files of one run merged: ``{"step_times": [..], "rounds": [costs ..], "errors": [..]}`` where
    ``step_times`` are the run's paired steps (``P`` of them, from ``S``) and round ``j`` was measured right before
    step ``j`` and round ``j + 1`` right after it. The first paired step and the round before it are dropped (the
    first alternation of the run's steps with the meter's rounds). A round that misses a stage (a rank's meter
    failed) is None."""
    per_rank, errors = [], []
    for rank in range(ranks):
        path = f"{prefix}.rank{rank}.json"
        if not os.path.exists(path):
            errors.append(f"rank {rank} wrote no {os.path.basename(path)}")
            continue
        with open(path) as handle:
            found = json.load(handle)
        per_rank.append(found["rounds"])
        if found.get("error"):
            errors.append(f"rank {rank}: {found['error']}")
    rounds = []
    for parts in zip(*per_rank) if per_rank else ():
        merged = {}
        for part in parts:
            merged.update(part["costs"] or {})
        rounds.append(merged if all(f"{s}F" in merged for s in range(num_stages)) else None)
    return {"step_times": list(step_times[1:]), "rounds": rounds[1:], "errors": errors}


def bracketed(paired: dict) -> list:
    """``[(costs, step time)]`` of one run's paired steps (:func:`read_paired`): each step with the per-key median of
    the rounds right before and after it (the mean of the two); steps next to a missing round are left out."""
    from tracepp.costs.model import median_costs

    rounds, steps = (paired or {}).get("rounds") or [], (paired or {}).get("step_times") or []
    return [(median_costs([rounds[j], rounds[j + 1]]), step) for j, step in enumerate(steps)
            if j + 1 < len(rounds) and rounds[j] and rounds[j + 1]]


def split_run_args(argv) -> tuple:
    """``(this tool's arguments, run.py's)`` of a command line that passes run.py's after a ``--``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv=None) -> None:
    argv, rest = split_run_args(argv)
    parser = argparse.ArgumentParser(prog="python -m tracepp.costs.measure_in_run", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--paired-from", type=int, required=True, help="the first paired step")
    parser.add_argument("--paired-steps", type=int, required=True, help="how many paired steps")
    parser.add_argument("--prefix", required=True, help="PREFIX of the per-rank JSON files")
    args = parser.parse_args(argv)
    out_dir = os.path.abspath(args.out_dir)
    sys.path.insert(0, out_dir)
    import tracepp_runtime  # the runtime copy that run.py imports

    PairedCosts(out_dir, args.paired_from, args.paired_steps, os.path.abspath(args.prefix),
                int(os.environ.get("RANK", "0"))).register(tracepp_runtime)
    sys.argv = [os.path.join(out_dir, "run.py")] + rest
    runpy.run_path(os.path.join(out_dir, "run.py"), run_name="__main__")


if __name__ == "__main__":
    main()
