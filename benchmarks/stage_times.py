"""Per-(stage, kind) compute times of tracepp output folders, and the ideal step time of their plans.

    python -m benchmarks.stage_times OUT_DIR [OUT_DIR ...] --json times.json [--device cpu] [--rounds 5]

For each folder, in this one process: every stage of the plan is loaded onto one device (weights from
``model()``, stage code from the generated ``rank*.py``) and driven by the runtime's own ``RankExecutor``
with a single-rank action list (``F`` of every stage, then ``B`` of every stage in reverse; then the same with
``I``/``W`` for the zero-bubble split), on the real microbatches of step 0. Each action is timed on its own
(CUDA synchronised around it); the cost of a (stage, kind) is the median over ``rounds`` x microbatches.
The SGD step over each stage's parameters is timed the same way (a rank's is the sum over its stages).

The ideal step time is ``codegen.simulate`` of the folder's own lowered plan with those costs and comms
free, plus each rank's optimizer step after its last action: ``max over ranks (end of last compute + SGD)``.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
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
    import tracepp_runtime.batching as batching
    import tracepp_runtime.executor as executor
    import tracepp_runtime.launch as launch

    return batching, executor, launch


def _stage_functions(out_dir: str, manifest: dict) -> dict:
    functions = {}
    for rank in sorted(set(manifest["plan"]["stage_to_rank"])):
        path = os.path.join(out_dir, f"rank{rank}.py")
        spec = importlib.util.spec_from_file_location(f"bench_rank{rank}_{abs(hash(out_dir))}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        functions.update(module.STAGE_FUNCTIONS)
    return functions


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(out_dir: str, device: torch.device, rounds: int = 5, max_microbatches: int = 4) -> dict:
    """{"costs": {"stage,kind": seconds}, "optimizer_stage_s": {stage: seconds}} for one output folder."""
    batching, executor_module, launch = _runtime(out_dir)
    with open(os.path.join(out_dir, "manifest.json")) as handle:
        manifest = json.load(handle)
    num_stages = len(manifest["stages"])
    single = copy.deepcopy(manifest)  # every stage on rank 0 of a one-rank "pipeline": no comms at all
    single["plan"]["stage_to_rank"] = [0] * num_stages
    for stage in single["stages"]:
        stage["rank"] = 0
    user = launch.load_user_module(out_dir)
    import tracepp_runtime.weights as weights

    state = weights.load_rank_state(out_dir, single, 0, device, user)
    functions = _stage_functions(out_dir, manifest)
    out_spec = launch.load_spec(manifest, "out_spec")
    inputs, kwargs, target = user.batch(0)
    mb = batching.BatchChecker(manifest).microbatches(0, tuple(inputs), kwargs, target, device)
    count = min(max_microbatches, len(mb.leaves))
    samples: dict = {}

    def run(kinds: tuple) -> None:
        actions, labels = [], []
        for m in range(count):
            order = [(s, "F") for s in range(num_stages)]
            for kind in kinds:
                order += [(s, kind) for s in reversed(range(num_stages))]
            for s, kind in order:
                actions.append(f"{s}{kind}{m}")
                labels.append((s, kind))
        ex = executor_module.RankExecutor(single, 0, functions, actions, state, device, user.loss_fn, 600.0,
                                          out_spec, True)
        ex.mb_leaves, ex.targets, ex.scales = mb.leaves, mb.targets, mb.scales
        ex.send_works, ex.outputs = {}, [None] * len(mb.leaves)
        ex.mb_shapes = [ex.shapes(**bound) for bound in mb.symbols]
        ex.step_loss = torch.zeros((), device=device)
        for runner in ex.stages.values():
            runner.reset(len(mb.leaves))
        assert len(ex.program) == len(labels)
        for (instruction, _releases), label in zip(ex.program, labels):
            _sync(device)
            start = time.perf_counter()
            instruction()
            _sync(device)
            samples.setdefault(label, []).append(time.perf_counter() - start)

    run(("B",))  # warm-up (allocator, lazy init), discarded
    run(("I", "W"))
    samples.clear()
    for _ in range(rounds):
        run(("B",))
        run(("I", "W"))
    costs = {f"{s},{kind}": statistics.median(v) for (s, kind), v in sorted(samples.items())}
    # the SGD step over each stage's parameters (gradients are left over from the runs above)
    optimizer_stage_s = {}
    for spec in manifest["stages"]:
        params = [state[ref["fqn"]] for ref in spec["state"] if ref["kind"] == "parameter"]
        params = [p for p in params if isinstance(p, torch.nn.Parameter) and p.requires_grad]
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
        optimizer_stage_s[str(spec["index"])] = statistics.median(times[1:])
    return {"costs": costs, "optimizer_stage_s": optimizer_stage_s, "microbatches_timed": count, "rounds": rounds}


def ideal_step(manifest: dict, costs: dict, optimizer_stage_s: dict, plan: dict = None) -> dict:
    """Simulate the folder's lowered plan (or ``plan``) with measured costs, comms free; see the module doc."""
    from tracepp.codegen.actions import Action
    from tracepp.codegen.simulate import simulate
    from tracepp.inspect import topology_from_manifest

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
    from tracepp.codegen.planning import build_plan
    from tracepp.inspect import topology_from_manifest

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
