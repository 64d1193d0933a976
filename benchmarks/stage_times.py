"""Per-(stage, kind) compute times of tracepp output folders, and the ideal step time of their plans.

    python -m benchmarks.stage_times OUT_DIR [OUT_DIR ...] --json times.json [--device cpu] [--rounds 5]

For each folder, in this one process: every stage of the plan is loaded onto one device by the runtime's
public ``Pipeline(out_dir, all_stages=True, actions=...)`` (weights from ``model()``, stage code from the
generated ``rank*.py``), with a single-rank action list (``F`` of every stage, then ``B`` of every stage in
reverse; then the same with ``I``/``W`` for the zero-bubble split), on the real microbatches of step 0. Each
action is timed on its own through ``Pipeline.set_action_hook`` (CUDA synchronised around it); the cost of a
(stage, kind) is the median over ``rounds`` x microbatches.
The SGD step over each stage's parameters is timed the same way (a rank's is the sum over its stages).

The ideal step time is ``codegen.simulate`` of the folder's own lowered plan with those costs and comms
free, plus each rank's optimizer step after its last action: ``max over ranks (end of last compute + SGD)``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _runtime(out_dir: str):
    """The tracepp_runtime package copied into an output folder (importable once per process)."""
    if "tracepp_runtime" not in sys.modules:
        sys.path.insert(0, os.path.abspath(out_dir))
    import tracepp_runtime

    return tracepp_runtime


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(out_dir: str, device: torch.device, rounds: int = 5, max_microbatches: int = 4) -> dict:
    """{"costs": {"stage,kind": seconds}, "optimizer_stage_s": {stage: seconds}} for one output folder.

    Uses the runtime's public API only: ``Pipeline(out_dir, all_stages=True, actions=...)`` (every stage in
    this process, no communication) and ``Pipeline.set_action_hook`` to time each action."""
    runtime = _runtime(out_dir)
    with open(os.path.join(out_dir, "manifest.json")) as handle:
        manifest = json.load(handle)
    num_stages = len(manifest["stages"])
    count = min(max_microbatches, manifest["plan"]["num_microbatches"])
    samples: dict = {}

    def actions_for(kinds: tuple) -> list:
        actions = []
        for m in range(count):
            order = [(s, "F") for s in range(num_stages)]
            for kind in kinds:
                order += [(s, kind) for s in reversed(range(num_stages))]
            actions += [f"{s}{kind}{m}" for s, kind in order]
        return actions

    pipes = {kinds: runtime.Pipeline(out_dir, all_stages=True, device=device, actions=actions_for(kinds))
             for kinds in (("B",), ("I", "W"))}
    inputs, kwargs, target = pipes[("B",)].user.batch(0)

    def timed(text: str, run) -> None:
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        kind = _compute_kind(text)
        samples.setdefault((int(text.split(kind)[0]), kind), []).append(time.perf_counter() - start)

    for pipe in pipes.values():
        pipe.set_action_hook(timed)

    def run(kinds: tuple) -> None:
        pipes[kinds].step(tuple(inputs), kwargs, target)

    run(("B",))  # warm-up (allocator, lazy init), discarded
    run(("I", "W"))
    samples.clear()
    for _ in range(rounds):
        run(("B",))
        run(("I", "W"))
    costs = {f"{s},{kind}": statistics.median(v) for (s, kind), v in sorted(samples.items())}
    # the SGD step over each stage's parameters (gradients are left over from the runs above)
    optimizer_stage_s = {}
    pipe = pipes[("B",)]
    for stage_index, stage in sorted(pipe.stages.items()):
        params = [p for p in stage.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer = torch.optim.SGD(params, lr=0.0)
        times = []
        for _ in range(rounds + 1):
            _sync(device)
            start = time.perf_counter()
            optimizer.step()
            _sync(device)
            times.append(time.perf_counter() - start)
        optimizer_stage_s[str(stage_index)] = statistics.median(times[1:])
    return {"costs": costs, "optimizer_stage_s": optimizer_stage_s, "microbatches_timed": count, "rounds": rounds}


def _compute_kind(action: str) -> str:
    """The compute kind of an action text such as '3W1'."""
    return next(kind for kind in "FBIW" if kind in action)


def ideal_step(manifest: dict, costs: dict, optimizer_stage_s: dict, plan: dict = None) -> dict:
    """Simulate the folder's lowered plan (or ``plan``) with measured costs, comms free; see the module doc."""
    from tracepp.runtime.actions import Action
    from tracepp.codegen.simulate import simulate
    from tracepp.manifest_file import topology_from_manifest

    plan = plan or manifest["plan"]
    actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
    keyed = {(int(k.split(",")[0]), k.split(",")[1]): v for k, v in costs.items()}
    sim = simulate(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                   costs=keyed, training=manifest["training"])
    optimizer_s = {r: sum(float(optimizer_stage_s.get(str(s), 0.0))
                          for s, owner in enumerate(plan["stage_to_rank"]) if owner == r) for r in sim.timeline}
    ends = {r: max([e for _, _, e in tl] + [0.0]) + optimizer_s[r] for r, tl in sim.timeline.items()}
    return {"ideal_step_s": max(ends.values()), "makespan_s": sim.makespan, "bubble": sim.bubble_overall}


def predict(manifest: dict, measured: dict, num_ranks: int) -> dict:
    """The ideal step time of the folder's schedule re-planned over ``num_ranks`` ranks (same stages)."""
    from tracepp.codegen.plan import build_plan
    from tracepp.manifest_file import topology_from_manifest

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
        measured = measure(out_dir, device, args.rounds)
        with open(os.path.join(out_dir, "manifest.json")) as handle:
            manifest = json.load(handle)
        measured.update(ideal_step(manifest, measured["costs"], measured["optimizer_stage_s"]))
        if args.predict_ranks:
            measured["predicted_ranks"] = args.predict_ranks
            measured["predicted_step_s"] = predict(manifest, measured, args.predict_ranks)["ideal_step_s"]
        results[out_dir] = measured
    with open(args.json, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
