"""Per-(stage, kind) compute times of tracepp output folders, and the ideal step time of their plans.

    python -m benchmarks.stage_times OUT_DIR [OUT_DIR ...] --json times.json [--device cpu] [--rounds 5]
        [--clock wall|cpu]

For each folder, in this one process:

* **the stage costs the ideal is priced with** (``costs``): ``tracepp.costs.measure_stages.measure_stage_times``, each
  stage's own generated function called with plain autograd on the real microbatches of step 0, no pipeline
  executor: F = forward; B = ``torch.autograd.backward`` of its outputs; I = ``torch.autograd.grad`` with
  ``inputs=`` the received activations; W = B - I, the weight half of the best possible split backward (the
  naive split, ``autograd.grad`` with ``inputs=`` the parameters, is kept as ``W_autograd``). These are what
  the stage's computation costs, so ideal / measured shows every overhead of tracepp's runtime, the zero-bubble
  path included.
* **the same kinds through tracepp's executor** (``executor_costs``): ``Pipeline(out_dir, all_stages=True,
  actions=...)`` with a single-rank action list (``F`` of every stage, then ``B`` of every stage in reverse;
  then the same with ``I``/``W``), each action timed through ``Pipeline.set_action_hook``. ``split_ratio``:
  per stage, tracepp's I + W over its own B (1.0: the split backward costs what one backward does) with the W
  run right after its I (``W_after_I``, as interleaved-zb runs it), the median over pairs of a B and the I and
  W of the next microbatch (``RuntimeCostMeter.split_ratios``: each pair sees one spell of the machine);
  ``split_ratio_plain``: the same over the plain-autograd B (medians, not paired), and
  ``split_ratio_deferred``: with the W run after the other stages' I's instead (paired). Printed per stage.
* the SGD step over each stage's parameters (a rank's is the sum over its stages).

Each cost is the median over ``rounds`` x microbatches (CUDA synchronised around each). The ideal step time
is ``codegen.simulate`` of the folder's own lowered plan with ``costs`` and comms free, plus each rank's
optimizer step after its last action: ``max over ranks (end of last compute + SGD)``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from tracepp.costs.model import W_AFTER_I
from tracepp.costs.measure_stages import CLOCKS, RuntimeCostMeter, _sync


class ExecutorMeter(RuntimeCostMeter):
    """The same kinds through tracepp's executor (``tracepp.costs.measure_stages.RuntimeCostMeter``, which ``tracepp
    calibrate`` uses for its runtime factors), plus the SGD step per stage."""

    def optimizer_times(self, rounds: int) -> dict:
        """The SGD step over each stage's parameters, median of ``rounds``."""
        optimizer_stage_s = {}
        for stage_index, stage in sorted(self.pipe.stages.items()):
            params = [p for p in stage.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer = torch.optim.SGD(params, lr=0.0)
            times = []
            for _ in range(rounds + 1):
                _sync(self.device)
                start = self.timer()
                optimizer.step()
                _sync(self.device)
                times.append(self.timer() - start)
            optimizer_stage_s[str(stage_index)] = statistics.median(times[1:])
        return optimizer_stage_s


def measure(out_dir: str, device: torch.device, rounds: int = 5, max_microbatches: int = 4,
            clock: str = "wall") -> dict:
    """Everything the module docstring lists for one folder; ``costs`` (keys ``"stage,kind"``) price the ideal.
    Rounds of the plain-autograd and the executor measurements alternate, so both see the same machine."""
    from tracepp.costs.measure_stages import StageCostMeter

    plain_meter = StageCostMeter(out_dir, device=device, max_microbatches=max_microbatches, clock=clock)
    executor_meter = ExecutorMeter(out_dir, device=device, max_microbatches=max_microbatches, clock=clock)
    for _ in range(rounds):
        plain_meter.run_round()
        executor_meter.run_round()
    plain = plain_meter.result()
    costs = {f"{int(key[:-1])},{key[-1]}": value for key, value in plain["costs"].items()}
    executor = executor_meter.costs()
    result = {"costs": costs, "executor_costs": executor, "optimizer_stage_s": executor_meter.optimizer_times(rounds),
              "W_autograd": plain["W_autograd"], "microbatches_timed": plain["microbatches_timed"],
              "rounds": rounds, "clock": clock,
              "costs_method": "plain autograd per stage (tracepp.costs.measure_stages), W = B - I",
              "split_ratio": {}, "split_ratio_plain": {}, "split_ratio_deferred": {}}
    paired = executor_meter.split_ratios()
    for stage in sorted({int(k.split(",")[0]) for k in executor}):
        i, w, b = (executor.get(f"{stage},{kind}") for kind in "IWB")
        after = executor.get(f"{stage},{W_AFTER_I}", w)
        ratios = paired.get(stage, {})
        if i is not None and after is not None and b:
            result["split_ratio"][str(stage)] = ratios.get(W_AFTER_I, ratios.get("W", (i + after) / b))
            result["split_ratio_plain"][str(stage)] = (i + after) / costs[f"{stage},B"]
            result["split_ratio_deferred"][str(stage)] = ratios.get("W", (i + w) / b)
    return result


def split_table(measured: dict) -> str:
    """Per stage: plain-autograd F, B, I, W and tracepp's executor F, B, I, W, W right after its I (ms), and
    tracepp's (I + W) / B with W right after I (over its own B and over the plain B) and with W deferred."""
    lines = ["stage  plain F/B/I/W ms              tracepp F/B/I/W/W_after_I ms       (I+W)/B tracepp  vs plain B"
             "  W deferred"]
    costs, executor = measured["costs"], measured["executor_costs"]
    nan = float("nan")
    for stage in sorted({int(k.split(",")[0]) for k in costs}):
        plain = "/".join(f"{costs.get(f'{stage},{k}', 0) * 1e3:.2f}" for k in "FBIW")
        ours = "/".join(f"{executor.get(f'{stage},{k}', 0) * 1e3:.2f}" for k in ("F", "B", "I", "W", W_AFTER_I))
        ratios = [measured.get(name, {}).get(str(stage))
                  for name in ("split_ratio", "split_ratio_plain", "split_ratio_deferred")]
        ratio, plain_ratio, deferred = (nan if value is None else value for value in ratios)
        lines.append(f"{stage:>5}  {plain:<28} {ours:<34} {ratio:>15.2f}  {plain_ratio:>9.2f}  {deferred:>10.2f}")
    return "\n".join(lines)


def ideal_step(manifest: dict, costs: dict, optimizer_stage_s: dict, plan: dict = None) -> dict:
    """Simulate the folder's lowered plan (or ``plan``) with measured costs (keys "0,F" or "0F"), comms free;
    see the module doc."""
    from benchmarks.predict import _keyed
    from tracepp.runtime.actions import Action
    from tracepp.codegen.simulate import simulate
    from tracepp.codegen.manifest import topology_from_manifest

    plan = plan or manifest["plan"]
    actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
    keyed = _keyed(costs)
    sim = simulate(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                   costs=keyed, training=manifest["training"])
    optimizer_s = {r: sum(float(optimizer_stage_s.get(str(s), 0.0))
                          for s, owner in enumerate(plan["stage_to_rank"]) if owner == r) for r in sim.timeline}
    ends = {r: max([e for _, _, e in tl] + [0.0]) + optimizer_s[r] for r, tl in sim.timeline.items()}
    return {"ideal_step_s": max(ends.values()), "makespan_s": sim.makespan, "bubble": sim.bubble_overall}


def predict(manifest: dict, measured: dict, num_ranks: int) -> dict:
    """The ideal step time of the folder's schedule re-planned over ``num_ranks`` ranks (same stages)."""
    from tracepp.codegen.plan import build_plan
    from tracepp.codegen.manifest import topology_from_manifest

    plan = manifest["plan"]
    built = build_plan(plan["schedule"], num_ranks, len(manifest["stages"]), plan["num_microbatches"],
                       topology_from_manifest(manifest), manifest["training"]).to_json()
    return ideal_step(manifest, measured["costs"], measured["optimizer_stage_s"], plan=built)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+")
    parser.add_argument("--json", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                        help="wall (perf_counter, default) or cpu (this thread's CPU time: steadier on a shared "
                             "machine; with 1 intra-op thread)")
    parser.add_argument("--predict-ranks", type=int, default=None,
                        help="also simulate the same schedule planned over this many ranks (predicted_step_s)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from benchmarks.memory import cuda_device_or_die

        device = cuda_device_or_die()
    else:
        device = torch.device("cpu")
    results = {}
    for out_dir in args.out_dirs:
        measured = measure(out_dir, device, args.rounds, clock=args.clock)
        with open(os.path.join(out_dir, "manifest.json")) as handle:
            manifest = json.load(handle)
        measured.update(ideal_step(manifest, measured["costs"], measured["optimizer_stage_s"]))
        measured["ideal_step_s_executor_costs"] = ideal_step(manifest, measured["executor_costs"],
                                                             measured["optimizer_stage_s"])["ideal_step_s"]
        if args.predict_ranks:
            measured["predicted_ranks"] = args.predict_ranks
            measured["predicted_step_s"] = predict(manifest, measured, args.predict_ranks)["ideal_step_s"]
        results[out_dir] = measured
        print(f"{out_dir}: ideal {measured['ideal_step_s'] * 1e3:.1f} ms (executor-priced "
              f"{measured['ideal_step_s_executor_costs'] * 1e3:.1f} ms)\n{split_table(measured)}", flush=True)
    with open(args.json, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
