"""Each stage's compute cost (F, B, I, W) measured with plain autograd in one process: no pipeline executor.

    from tracepp.costs.measure_stages import measure_stage_costs
    costs = measure_stage_costs("out/")             # {"0F": s, "0B": s, "0I": s, "0W": s, "1F": s, ...}

    python -m tracepp.costs.measure_stages out/ -o costs.json [--rounds 5] [--clock wall|cpu]
    tracepp plan out/ --costs costs.json             # the same keys `tracepp plan --costs` reads

What is timed, for every stage of an output folder and each of its first ``max_microbatches`` microbatches
of ``batch(0)`` (the model file's real data, its weights from ``model()``): the stage's generated function
(from the rank scripts, through the runtime's ``StageModule``), called directly, its received activations
detached leaves as a pipeline stage sees them:

* ``F``: the forward (the last stage's includes ``loss_fn``);
* ``B``: ``torch.autograd.backward(outputs, grad_outputs)``: input and weight gradients in one pass, and the
  graph freed after it (every runtime pays that once per backward);
* ``I``: ``torch.autograd.grad(outputs, inputs=received activations, grad_outputs, retain_graph=True)``:
  autograd runs only what the input gradients need (no weight-gradient kernels);
* ``W``: ``B - I``, the weight half of the best possible split backward, whose two halves together do the
  work of one full backward. ``W_autograd`` in :func:`measure_stage_times` is the naive split instead,
  ``torch.autograd.grad(outputs, inputs=parameters, grad_outputs)`` after I: it repeats the activation-gradient
  chain from the outputs down to the first weight, so I + W_autograd is 1.5 to 2 B;
  it is reported, not used as the cost.

The ``grad_outputs`` are the real gradients of a full backward of the whole model (each stage's received
activations' gradients, summed over consumers, are its producer's output gradients). A stage that receives
no activation needing a gradient has I = 0 (written as 1e-9 s, since costs files hold positive times) and
W = B. Each cost is the median over ``rounds`` x microbatches; ``clock`` is ``time.perf_counter`` (wall) or
``time.thread_time`` (CPU time of this thread: steadier on a shared machine, equal to the wall time of a
1-thread CPU stage when nothing else competes). These are the costs of the stages' own computation, the
floor any runtime's F, B, I and W can approach: the benchmark's ``ideal`` (``benchmarks/stage_times.py``)
simulates the plan with them.

:class:`RuntimeCostMeter` times the same kinds through tracepp's own executor (its zero-bubble split and its
bookkeeping included); :func:`measure_runtime_costs` alternates its rounds with the plain ones, and ``tracepp
calibrate`` turns the pair into per-kind runtime factors (``tracepp.costs.model.runtime_factors``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from tracepp.costs.model import W_AFTER_I
from tracepp.runtime.actions import Action

NOTHING = 1e-9  # the cost written for a stage's I when it has no input gradient to compute (costs must be > 0)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _host_memory_as_ranks(device: torch.device) -> None:
    """Set glibc's heap thresholds the way ``run.py`` sets them on a CPU rank (``runtime/host_memory.py``), so a
    stage is timed with the memory behaviour it has in a run. Left at glibc's defaults, the executor's rounds took
    0 - 5,900 page faults each (3.7 us apiece on the project's VM) depending on what the process had freed
    before, and the plain rounds none: the runtime factors moved with the fault count, not with the runtime."""
    from tracepp.runtime import host_memory

    host_memory.configure(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageCallables:
    """Every stage of an output folder in this process, callable one at a time with plain autograd, on the
    real microbatches of ``batch(step)``. ``forward(stage, mb)`` -> (received leaves needing gradients,
    differentiable outputs, their output gradients); the output gradients come from one full backward of the
    whole model made at construction."""

    def __init__(self, folder: str, device="cpu", precision=None, max_microbatches: int = 4,
                 step: int = 0):
        from tracepp.runtime.launch import user_batch
        from tracepp.runtime.pipeline import Pipeline
        import torch.utils._pytree as pytree

        self.device = torch.device(device)
        _host_memory_as_ranks(self.device)
        # plain stages: the cost model prices recomputation itself (codegen.memory.RECOMPUTE_SHARE)
        pipe = Pipeline(folder, all_stages=True, device=self.device, precision=precision, check_finite=False,
                        actions=[], activation_checkpointing="none")
        self.pipe = pipe
        self.manifest = manifest = pipe.manifest
        self.training = manifest["training"]
        self.num_stages = len(manifest["stages"])
        self.specs = manifest["stages"]
        self.modules = pipe.stages
        self.params = {s: [p for p in module.parameters() if p.requires_grad] for s, module in self.modules.items()}
        args, kwargs, target = user_batch(pipe.user, step, self.training)
        batches = pipe.splitter.split(step, tuple(args), kwargs, target, self.device)
        self.count = min(max_microbatches, len(batches.leaves))
        self.batches = batches
        self.shapes = [pipe.executor.shapes(**bound) for bound in batches.symbols]
        self._pytree = pytree
        self._out_spec = pipe._out_spec
        self.loss_fn = pipe.loss_fn
        # the reference pass: every stage's received values per microbatch, and its output gradients
        self.values = [{} for _ in range(self.count)]  # mb -> {(producer, name): detached tensor}
        self.out_grads = [{} for _ in range(self.count)]  # mb -> {(stage, output position): gradient}
        for mb in range(self.count):
            for s in range(self.num_stages):
                _received, _loss, out = self._call(s, mb)
                for pos, name in enumerate(self.specs[s]["outputs"]):
                    if isinstance(out[pos], torch.Tensor):
                        self.values[mb][(s, name)] = out[pos].detach()
            if not self.training:
                continue
            for s in reversed(range(self.num_stages)):  # consumers first: their input gradients are ours
                received, tensors, grads = self.forward(s, mb)
                if not tensors or not received:
                    continue
                found = torch.autograd.grad(tensors, received, grads, allow_unused=True)
                items = [item for item in self.specs[s]["received"] if item["requires_grad"]]
                for item, value, grad in zip(items, received, found):
                    key = (item["producer"], self.specs[item["producer"]]["outputs"].index(item["name"]))
                    grad = torch.zeros_like(value) if grad is None else grad
                    sums = self.out_grads[mb]
                    sums[key] = grad if key not in sums else sums[key] + grad

    def _call(self, s: int, mb: int):
        """Run stage ``s`` on microbatch ``mb``: (received inputs, fresh leaves where they need gradients;
        [the loss] on the last stage of a training folder, else None; the stage's outputs)."""
        spec = self.specs[s]
        leaves = self.batches.leaves[mb]
        received = []
        for item in spec["received"]:
            value = self.values[mb][(item["producer"], item["name"])]
            received.append(value.detach().requires_grad_(True) if self.training and item["requires_grad"]
                            else value)
        args = [leaves[i] for i in spec["root_leaf_indices"]] + received
        args += [self.shapes[mb][item["name"]] for item in spec.get("sym_inputs", [])]
        with torch.set_grad_enabled(self.training):
            out = self.modules[s](*args)
            if s == self.num_stages - 1 and self.loss_fn is not None and self.batches.targets[mb] is not None:
                leaves_out = [out[i] if kind == "value" else const
                              for i, (kind, const) in enumerate(self.manifest["output_leaves"])]
                output = self._pytree.tree_unflatten(leaves_out, self._out_spec)
                loss = self.loss_fn(output, self.batches.targets[mb]).float() * self.batches.scales[mb]
                return received, [loss], out
        return received, None, out

    def forward(self, s: int, mb: int):
        """Stage ``s``'s forward on microbatch ``mb``: (received leaves needing gradients, the tensors a
        backward starts from (the loss on the last stage), their gradients (None for the loss))."""
        received, loss, out = self._call(s, mb)
        wanted = [value for value, item in zip(received, self.specs[s]["received"])
                  if item["requires_grad"] and isinstance(value, torch.Tensor) and value.requires_grad]
        if loss is not None:
            return wanted, loss, [None]
        tensors, grads = [], []
        for pos, _name in enumerate(self.specs[s]["outputs"]):
            grad = self.out_grads[mb].get((s, pos))
            if grad is not None and isinstance(out[pos], torch.Tensor) and out[pos].requires_grad:
                tensors.append(out[pos])
                grads.append(grad.to(out[pos].dtype))
        return wanted, tensors, grads


class StageCostMeter:
    """Times rounds of every stage's F, B, I and W_autograd (see the module docstring); :meth:`result` summarises.
    Rounds can be interleaved with other measurements (``benchmarks/stage_times.py`` alternates them with the
    same kinds through tracepp's executor, so both see the same machine; ``tracepp.costs.measure_in_run`` with a run's
    own steps, each rank timing its own ``stages`` without ``naive_weight``)."""

    def __init__(self, folder: str, *, device="cpu", precision=None, max_microbatches: int = 4,
                 clock: str = "wall", step: int = 0, stages=None, naive_weight: bool = True):
        self.timer = CLOCKS[clock]
        self.clock = clock
        self.runner = StageCallables(folder, device, precision, max_microbatches, step)
        # the stages timed (default all; a rank of a run times its own) and whether W_autograd is timed too
        self.stages = list(range(self.runner.num_stages)) if stages is None else sorted(stages)
        self.naive_weight = naive_weight
        self.samples: dict = {}
        self.rounds = 0
        self.run_round()  # warm-up (allocator, lazy init), dropped
        self.samples.clear()
        self.rounds = 0

    def _timed(self, key: str, fn):
        device = self.runner.device
        _sync(device)
        start = self.timer()
        result = fn()
        _sync(device)
        self.samples.setdefault(key, []).append(self.timer() - start)
        return result

    @staticmethod
    def _backward_and_free(graph: list) -> None:
        """A full backward of ``graph`` (``[received, tensors, grads]``), then the graph dropped: its nodes and
        what they saved are freed inside the timing, as a runtime frees them after every backward (0.07 - 0.09 ms
        of a 4.4 ms B on the CPU quick suite's last stage; tracepp's executor times its release inside B and W)."""
        _received, tensors, grads = graph
        graph.clear()
        torch.autograd.backward(tensors, grads)
        del _received, tensors, grads

    @staticmethod
    def _accumulate(params, grads) -> None:
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)

    def run_round(self) -> None:
        runner, timed = self.runner, self._timed
        for s in self.stages:
            params = runner.params[s]
            for mb in range(runner.count):
                received, tensors, grads = timed(f"{s}F", lambda: runner.forward(s, mb))
                if not runner.training or not tensors:
                    continue
                graph = [received, tensors, grads]
                del received, tensors, grads
                timed(f"{s}B", lambda: self._backward_and_free(graph))
                received, tensors, grads = runner.forward(s, mb)
                if received:
                    timed(f"{s}I", lambda: torch.autograd.grad(tensors, received, grads, retain_graph=True,
                                                               allow_unused=True))
                if params and self.naive_weight:
                    timed(f"{s}W_autograd", lambda: self._accumulate(params, torch.autograd.grad(
                        tensors, params, grads, allow_unused=True)))
                del received, tensors, grads
            for param in params:
                param.grad = None
        self.rounds += 1

    def result(self) -> dict:
        """``{"costs": {"0F": s, ...}, "W_autograd": {"0": s}, "samples": {"0F": [s, ...]},
        "microbatches_timed": n, "rounds": r, "clock": clock}`` (medians of the rounds run so far; the timed
        stages' keys only)."""
        runner = self.runner
        medians = {key: statistics.median(values) for key, values in self.samples.items()}
        costs, naive = {}, {}
        for s in self.stages:
            costs[f"{s}F"] = max(medians.get(f"{s}F", NOTHING), NOTHING)
            if not runner.training:
                continue
            full = max(medians.get(f"{s}B", NOTHING), NOTHING)
            inputs = min(medians.get(f"{s}I", 0.0), full)
            costs[f"{s}B"] = full
            costs[f"{s}I"] = max(inputs, NOTHING)
            costs[f"{s}W"] = max(full - inputs, NOTHING)
            if f"{s}W_autograd" in medians:
                naive[str(s)] = medians[f"{s}W_autograd"]
        return {"costs": costs, "W_autograd": naive, "samples": self.samples, "microbatches_timed": runner.count,
                "rounds": self.rounds, "clock": self.clock}


class RuntimeCostMeter:
    """The same kinds through tracepp's own executor, a round at a time: what the runtime takes for each stage's
    F, B, I and W (its zero-bubble split, its bookkeeping) where :class:`StageCostMeter` times the stage functions
    alone. Uses the runtime's public API only: ``Pipeline(folder, all_stages=True, actions=...)`` (every stage in
    this process, no communication) with a single-rank action list (for one microbatch ``F`` of every stage, then
    ``B`` of every stage in reverse; for the next one the same with ``I`` then ``W``) and
    ``Pipeline.set_action_hook`` timing each action. One pipeline holds the model once (two where the plan has a
    single microbatch). :meth:`costs`: ``{"stage,kind": s}``, medians over rounds x microbatches.

    A W is timed in both places a plan puts it: every other ``I``/``W`` microbatch runs all the I's, then all the
    W's (each W after other stages' work: kind ``W``), the others run each stage's W right after its own I (kind
    ``W_after_I``: interleaved-zb's order, where the captured gradients and saved inputs are still in cache). With
    a single ``I``/``W`` microbatch only the first is timed."""

    def __init__(self, folder: str, device="cpu", max_microbatches: int = 4, clock: str = "wall",
                 precision=None):
        from tracepp.codegen.manifest import load_manifest
        from tracepp.runtime.launch import user_batch
        from tracepp.runtime.pipeline import Pipeline

        self.device, self.timer = torch.device(device), CLOCKS[clock]
        _host_memory_as_ranks(self.device)
        manifest = load_manifest(folder)
        num_stages = len(manifest["stages"])
        available = manifest["plan"]["num_microbatches"]
        self.by_microbatch: dict = {}  # (stage, "F"/"B"/"I"/"W", microbatch) -> one time per round

        def actions(mb: int, kinds: tuple) -> list:
            order = [(s, "F") for s in range(num_stages)]
            if kinds == ("I", "W") and mb in self.after_input:  # each W right after its own I
                order += [(s, kind) for s in reversed(range(num_stages)) for kind in kinds]
            else:
                for kind in kinds:
                    order += [(s, kind) for s in reversed(range(num_stages))]
            return [f"{s}{kind}{mb}" for s, kind in order]

        def pipeline(action_list: list):
            return Pipeline(folder, all_stages=True, device=self.device, precision=precision, actions=action_list,
                            activation_checkpointing="none")

        if available >= 2:  # microbatches 2k run F + B, 2k + 1 run F + I + W, in one pipeline
            count = min(max_microbatches, available // 2)
            # every other F + I + W microbatch runs each W right after its I (timed as W_after_I)
            self.after_input = {2 * k + 1 for k in range(count) if k % 2 == 1}
            self.pipes = [pipeline([a for k in range(count)
                                    for a in actions(2 * k, ("B",)) + actions(2 * k + 1, ("I", "W"))])]
        else:
            self.after_input = set()
            self.pipes = [pipeline(actions(0, ("B",))), pipeline(actions(0, ("I", "W")))]
        self.pipe = self.pipes[0]
        self.batch = user_batch(self.pipe.user, 0, self.pipe.training)
        for pipe in self.pipes:
            pipe.set_action_hook(self._timed)
        # (microbatch of a B, microbatch of the I and W timed right after it) for split_ratios
        self.pairs = [(2 * k, 2 * k + 1) for k in range(count)] if available >= 2 else [(0, 0)]
        self.run_round()  # warm-up (allocator, lazy init), discarded
        self.by_microbatch.clear()

    def _timed(self, text: str, run) -> None:
        _sync(self.device)
        start = self.timer()
        run()
        _sync(self.device)
        action = Action.parse(text)
        self.by_microbatch.setdefault((action.stage, action.kind, action.mb), []).append(self.timer() - start)

    @property
    def samples(self) -> dict:
        """``{(stage, kind): times}``: the times of every microbatch, a W of an ``after_input`` microbatch as kind
        ``W_after_I``."""
        found: dict = {}
        for (stage, kind, mb), times in self.by_microbatch.items():
            kind = W_AFTER_I if kind == "W" and mb in self.after_input else kind
            found.setdefault((stage, kind), []).extend(times)
        return found

    def run_round(self) -> None:
        inputs, kwargs, target = self.batch
        for pipe in self.pipes:
            pipe.step(tuple(inputs), kwargs, target)
            pipe.zero_grad()

    def costs(self) -> dict:
        return {f"{s},{kind}": statistics.median(v) for (s, kind), v in sorted(self.samples.items())}

    def split_ratios(self) -> dict:
        """Per stage, the executor's (I + W) / B as the median of per-pair ratios: each B next to the I and W of
        the microbatch run right after it in the same round, so a pair sees one spell of the machine (a ratio of
        medians over rounds moved +-10% between runs on a stage with no I, whose ratio is 1 by construction).
        ``{stage: {"W_after_I": r, "W": r}}``: pairs whose W ran right after its own I, and deferred ones."""
        ratios: dict = {}
        stages = sorted({stage for stage, _kind, _mb in self.by_microbatch})
        for stage in stages:
            for b_mb, split_mb in self.pairs:
                full = self.by_microbatch.get((stage, "B", b_mb), [])
                parts = [self.by_microbatch.get((stage, kind, split_mb), []) for kind in "IW"]
                kind = W_AFTER_I if split_mb in self.after_input else "W"
                for b, i, w in zip(full, *parts):
                    ratios.setdefault(stage, {}).setdefault(kind, []).append((i + w) / b)
        return {stage: {kind: statistics.median(values) for kind, values in found.items()}
                for stage, found in ratios.items()}


def measure_runtime_costs(folder: str, *, device="cpu", rounds: int = 5, max_microbatches: int = 4,
                          precision=None, clock: str = "wall") -> dict:
    """``{"costs": plain, "runtime_costs": tracepp's}`` (both ``{"0F": s, ...}``) from alternating rounds of
    :class:`StageCostMeter` and :class:`RuntimeCostMeter`, so both see the same spells of the machine; their
    per-kind ratios are the calibration's ``runtime_factors`` (``tracepp.costs.model.runtime_factors``)."""
    plain = StageCostMeter(folder, device=device, precision=precision, max_microbatches=max_microbatches,
                           clock=clock)
    runtime = RuntimeCostMeter(folder, device=device, max_microbatches=max_microbatches, clock=clock,
                               precision=precision)
    for _ in range(rounds):
        plain.run_round()
        runtime.run_round()
    return {"costs": plain.result()["costs"],
            "runtime_costs": {key.replace(",", ""): value for key, value in runtime.costs().items()}}


def measure_stage_times(folder: str, *, device="cpu", rounds: int = 5, max_microbatches: int = 4,
                        precision=None, clock: str = "wall", step: int = 0) -> dict:
    """Every sample behind :func:`measure_stage_costs` (:meth:`StageCostMeter.result`)."""
    meter = StageCostMeter(folder, device=device, precision=precision, max_microbatches=max_microbatches,
                           clock=clock, step=step)
    for _ in range(rounds):
        meter.run_round()
    return meter.result()


def measure_stage_costs(folder: str, *, device="cpu", rounds: int = 5, max_microbatches: int = 4,
                        precision=None, clock: str = "wall") -> dict:
    """``{"0F": s, "0B": s, "0I": s, "0W": s, "1F": s, ...}``: seconds per microbatch of each stage's forward,
    full backward, input-gradient and weight-gradient halves, measured with plain autograd in this process (see
    the module docstring); the format ``tracepp plan --costs`` reads (``tracepp.costs.costs_file``). Forward-only
    folders give F only."""
    return measure_stage_times(folder, device=device, rounds=rounds, max_microbatches=max_microbatches,
                               precision=precision, clock=clock)["costs"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracepp.costs.measure_stages", description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="an output folder of tracepp split")
    parser.add_argument("-o", "--output", default=None, help="write the costs JSON here (default: stdout)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches timed per round (default 4)")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16", "fp8"],
                        help="default: what the folder was split for")
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCKS))
    args = parser.parse_args(argv)
    costs = measure_stage_costs(args.folder, device=args.device, rounds=args.rounds,
                                max_microbatches=args.microbatches, precision=args.precision, clock=args.clock)
    text = json.dumps(costs, indent=1)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
