"""What the zero-bubble split backward costs against one full backward, per stage, with and without W's
matmul recipes (``runtime.executor.WeightSplit.matmul_recipes``), in one process.

    python -m benchmarks.studies.weight_split OUT_DIR [OUT_DIR ...] [--rounds 40] [--empty-grads]

For each stage that receives an activation needing a gradient, on the folder's real microbatches (step 0, up to
4): a forward, then one of (a) ``torch.autograd.backward`` of the outputs (B), (b) the runtime's I then W with
recipes, (c) the same with every matmul entry run through autograd's engine; the three alternate round by round,
and each is the median over ``rounds`` (the first 4 dropped). Prints (I + W) / B of (b) and (c) per stage.

Each round starts with every weight holding a gradient, as on every microbatch of a step but its first: B's
engine then adds each weight gradient into ``.grad``, and W adds its recipes' products there inside the matmul
(``executor._recipe_accumulate``). ``--empty-grads`` times the first microbatch instead (``.grad`` empty: both take
the fresh gradient as it is).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def measure(out_dir: str, rounds: int, empty_grads: bool = False) -> dict:
    from tracepp.runtime.executor import WeightSplit
    from tracepp.costs.measure_stages import StageCallables

    class EngineOnly(WeightSplit):
        matmul_recipes = False

    callables = StageCallables(out_dir, max_microbatches=4)
    result = {}
    for stage, params in sorted(callables.params.items()):
        splits = {"recipes": WeightSplit(params), "engine": EngineOnly(params)}
        times = {"B": [], "recipes": [], "engine": []}
        for index in range(rounds):
            for kind in times:
                for param in params:
                    param.grad = None if empty_grads else torch.zeros_like(param)
                received, tensors, grads = callables.forward(stage, index % 4)
                if kind != "B" and not received:
                    break  # the first stage: nothing to split off
                start = time.perf_counter()
                if kind == "B":
                    torch.autograd.backward(tensors, grads)
                else:
                    _inputs, pending, keep = splits[kind].input_backward(tensors, grads, received)
                    WeightSplit.weight_backward(pending, tensors if keep else None, grads if keep else None)
                times[kind].append(time.perf_counter() - start)
        if not times["recipes"]:
            continue
        full = statistics.median(times["B"][4:])
        result[stage] = {"B_s": full, **{f"{kind}_ratio": statistics.median(times[kind][4:]) / full
                                        for kind in ("recipes", "engine")}}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--empty-grads", action="store_true",
                        help="time the first microbatch of a step (no gradient held yet) instead of the later ones")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for out_dir in args.out_dirs:
        for stage, row in measure(out_dir, args.rounds, args.empty_grads).items():
            print(f"{out_dir} stage {stage}: B {row['B_s'] * 1e3:.2f} ms, (I + W) / B with recipes "
                  f"{row['recipes_ratio']:.3f}, through the engine {row['engine_ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
