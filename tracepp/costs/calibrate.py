"""``tracepp calibrate OUT``: measure what the simulator needs on this machine and write ``OUT/calibration.json``.

    tracepp calibrate out/ [--costs COSTS.json ...] [--comm COMM.json | --nproc N] [--fit-steps K | --no-fit]
                      [--repeats R]

Three parts (the file's sections, see ``tracepp.costs.model``):

1. **comm**: a ping-pong between every pair of neighbouring ranks (``tracepp.costs.measure_comm``, launched here with
   ``torchrun --nproc-per-node N``, N = the plan's ranks x data-parallel replicas unless ``--nproc``): latency and
   bandwidth per pair. ``--comm FILE`` takes the JSON of a run made elsewhere instead (several nodes:
   ``torchrun --nnodes ... -m tracepp.costs.measure_comm --json FILE``).
2. **compute**: each stage's F, B, I, W seconds per microbatch, from ``--costs FILE`` (the ``tracepp plan --costs``
   format; repeat it with files measured at other microbatch sizes, each with a ``"microbatch_size"`` key, so
   the tuner can price other microbatch counts), else the plain-autograd
   measurement of each stage's generated function (``tracepp.costs.measure_stages.measure_stage_costs``), taken
   ``--repeats`` times (default 3: two before the calibration run, one after) and the median used.
   **runtime**: then the same stages once more, in rounds alternating with the same kinds run through
   tracepp's own executor in one process (``tracepp.costs.measure_stages.measure_runtime_costs``): per kind, the median
   over stages of the executor's time over the stage function's is a factor the simulator multiplies the
   compute costs by (the zero-bubble split's I and W, the executor's bookkeeping; on the CPU quick suite
   F x0.88 - 1.10, B x0.94 - 1.10, I x1.09 - 1.36, W x1.02 - 1.21). A W right after its own I has a factor of
   its own (``W_after_I``; the simulator uses it for the W's a plan runs there). ``--no-runtime`` (or ``--costs``)
   leaves them at 1.
3. **overhead**: a short run of the folder itself (``torchrun ... OUT/run.py --steps K --metrics``); one number
   is fitted so that the simulator's step time equals the measured median: by default (``--overhead busy``) the
   runtime's fixed cost per compute action and per comm op (rank time), or (``delay``) a delay added to every
   message beyond the ping-pong's latency (idle time: a receiver busy computing sees the message late; on shared
   CPU cores the process that waits gets its time slice late), or (``scale``) the fraction by which every compute
   action is slower in the run than its measured cost. If the prediction without it is already slower, what is
   left is a small negative per-step term. ``--no-fit`` leaves it at 0. The run then goes on for
   ``--paired-steps`` (default 6 on CPU hosts, 0 with CUDA) more steps, each between two rounds of stage costs
   its own ranks measure in the run (``tracepp.costs.measure_in_run``); the number is fitted to each of those steps with
   the costs measured around it, and their median is kept (the run's median step and the stage costs measured
   apart can see spells of a shared machine 10 - 40% apart; a paired step and its costs see the same one).

And how far the machine's own speed moved while it was measured (the file's ``noise``): the spread of the plan's
comm-free step priced with each repeat of the stage costs, and the interquartile spread of the calibration run's
steps. A prediction is no closer to a measured step than that; above :data:`NOISE_WARNING` it says so.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

from tracepp.costs.model import (Calibration, folder_record, interquartile_fraction, median_costs, predict_folder,
                                 relative_range, runtime_factors, traced_microbatch, write_calibration)
from tracepp.runtime.mesh import mesh_layout

# The plain-autograd stage timing (branch perf): ``measure_stage_costs(folder, ...) -> {"0F": s, ...}``. Used when
# no --costs file is given; the name is looked up at call time, so the module may arrive later.
WARMUP_STEPS = 3
PAIRED_STEPS = 6  # steps of the calibration run priced with the stage costs measured around each (paired_costs)
MAX_NEGATIVE_STEP_FRACTION = 0.2  # a prediction above the measured step by more than this is not fitted
# What the one fitted number is (see overhead_of): "busy", a rank time per compute action and comm op. Chosen on
# three CPU quick suites with paired steps (12 cases, each paired step priced with stage costs its own ranks measured
# a second before and after it, the number fitted per step and used leave-one-out): 12 within 10%, median error
# 3.1%, worst 9.1% with "busy"; 10, 3.7% and 16.3% with a "delay" per message; 11, 1.9% and 13.8% with "scale".
# Nine earlier suites without paired steps (their steps and costs minutes apart) had put "delay" ahead, 30 of 36
# within 10% against 27, inside that pairing's noise (README "Benchmarks")
FIT_MODES = ("delay", "busy", "scale")
FIT_MODE = "busy"
REPEATS = 3  # plain-autograd stage-cost measurements (their median is used; their spread is recorded as noise)
NOISE_WARNING = 0.10  # a machine whose speed moved more than this while calibrating is named in a warning


def torchrun(nproc: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def _env(threads: Optional[int]) -> dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _run(cmd: list, timeout: float, what: str, env: dict) -> str:
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish in {timeout:.0f} s: {' '.join(cmd)}") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-8:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


def measure_comm(nproc: int, sizes: Optional[str] = None, rounds: int = 20, timeout: float = 300.0,
                 threads: Optional[int] = 1) -> dict:
    """The ping-pong of ``tracepp.costs.measure_comm`` over ``nproc`` local processes; its JSON report."""
    with tempfile.TemporaryDirectory(prefix="tracepp_comm_") as work:
        path = os.path.join(work, "comm.json")
        cmd = torchrun(nproc) + ["-m", "tracepp.costs.measure_comm", "--json", path, "--rounds", str(rounds)]
        if sizes:
            cmd += ["--sizes", sizes]
        _run(cmd, timeout, "the ping-pong (tracepp.costs.measure_comm)", _env(threads))
        with open(path) as handle:
            return json.load(handle)


def run_folder(out_dir: str, steps: int, nproc: int, timeout: float = 600.0, threads: Optional[int] = 1,
               extra: Optional[list] = None, launcher: Optional[list] = None) -> list:
    """Run the folder's ``run.py`` for ``steps`` steps; the step times of its ``--metrics`` lines. ``launcher``:
    what torchrun starts instead of the script, with run.py's arguments after it (``-m tracepp.costs.measure_in_run``)."""
    with tempfile.TemporaryDirectory(prefix="tracepp_fit_") as work:
        metrics = os.path.join(work, "metrics.jsonl")
        cmd = torchrun(nproc) + (list(launcher) if launcher else [os.path.join(out_dir, "run.py")])
        cmd += ["--steps", str(steps), "--metrics", metrics, "--quiet"] + list(extra or [])
        _run(cmd, timeout, f"the calibration run of {out_dir}", _env(threads))
        with open(metrics) as handle:
            return [json.loads(line)["step_time_s"] for line in handle if line.strip()]


def run_folder_paired(out_dir: str, steps: int, nproc: int, paired_steps: int, num_stages: int,
                      timeout: float = 600.0, threads: Optional[int] = 1) -> tuple:
    """:func:`run_folder` for ``steps`` steps, then ``paired_steps`` more (after one to settle), each between two
    rounds of in-run stage costs (``tracepp.costs.measure_in_run``): (the first ``steps`` step times, the paired steps
    with their costs as ``tracepp.costs.measure_in_run.read_paired`` gives them)."""
    from tracepp.costs.measure_in_run import read_paired

    with tempfile.TemporaryDirectory(prefix="tracepp_paired_") as work:
        prefix = os.path.join(work, "paired")
        launcher = ["-m", "tracepp.costs.measure_in_run", out_dir, "--paired-from", str(steps),
                    "--paired-steps", str(paired_steps + 1), "--prefix", prefix, "--"]
        times = run_folder(out_dir, steps + paired_steps + 1, nproc, timeout, threads, launcher=launcher)
        return times[:steps], read_paired(prefix, nproc, num_stages, times[steps:])


def fit_paired(manifest: dict, calibration: Calibration, paired: dict, precision: str = "fp32",
               mode: Optional[str] = None) -> list:
    """The overhead fitted to each paired step (``tracepp.costs.measure_in_run.bracketed``) with the stage costs measured
    around it in place of the calibration's: ``[(value, measured step, simulated step without overheads)]`` of the
    fits in ``mode`` (those that fell back to another mode are left out)."""
    import copy

    from tracepp.costs.measure_in_run import bracketed

    mode = mode or FIT_MODE
    values = []
    for costs, step in bracketed(paired):
        trial = copy.deepcopy(calibration)
        trial.compute = [{"microbatch_size": traced_microbatch(manifest), "costs": dict(costs)}]
        found = fit_overheads(manifest, trial, step, precision, mode)
        if found["mode"] == mode:
            values.append((found["value"], step, found["unfitted_step_s"]))
    return values


def _on_rank_device(measure, out_dir: str):
    """``measure(out_dir, device=...)`` on the ranks' device; on CPU with the intra-op threads a rank has
    (torchrun's OMP_NUM_THREADS: 1 unless set)."""
    import torch

    if torch.cuda.is_available():
        return measure(out_dir, device="cuda")
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        return measure(out_dir, device="cpu")
    finally:
        torch.set_num_threads(before)


def measured_stage_costs(out_dir: str) -> dict:
    """The plain-autograd measurement of the folder's stages (:func:`tracepp.costs.measure_stages.measure_stage_costs`)."""
    from tracepp.costs.measure_stages import measure_stage_costs

    return _on_rank_device(measure_stage_costs, out_dir)


def measured_runtime_costs(out_dir: str) -> dict:
    """Alternating rounds of the plain-autograd measurement and of the same stages through tracepp's executor
    (:func:`tracepp.costs.measure_stages.measure_runtime_costs`): ``{"costs": ..., "runtime_costs": ...}``."""
    from tracepp.costs.measure_stages import measure_runtime_costs

    return _on_rank_device(measure_runtime_costs, out_dir)


def _set_runtime_factors(calibration: Calibration, out_dir: str, log) -> None:
    """The ``runtime`` section: per kind, tracepp's executor time over the stage function's own (see
    :func:`tracepp.costs.model.runtime_factors`)."""
    log("runtime factors: the same stages through tracepp's executor, alternating with plain autograd ...")
    measured = measured_runtime_costs(out_dir)
    factors = runtime_factors(measured["costs"], measured["runtime_costs"])
    calibration.runtime = {"factors": factors, "costs": measured["costs"], "runtime_costs": measured["runtime_costs"],
                           "source": "tracepp.costs.measure_stages.measure_runtime_costs (one process, alternating rounds)"}
    log("  " + ", ".join(f"{kind} x{value:.3f}" for kind, value in factors.items())
        + " (tracepp's executor over the stage functions alone)")


def compute_entries(manifest: dict, costs_paths: list) -> list:
    """The ``compute`` section: one entry per costs file (or the hook's measurement)."""
    from tracepp.costs.costs_file import load_costs, load_costs_metadata

    num_stages = len(manifest["stages"])
    entries = []
    for path in costs_paths:
        costs = load_costs(path, num_stages)
        meta = load_costs_metadata(path)
        missing = [s for s in range(num_stages) if (s, "F") not in costs and "F" not in costs]
        if missing:
            raise ValueError(f"--costs {path}: no forward time for stages {missing}; give '<stage>F' keys")
        flat = {}
        for s in range(num_stages):
            for kind in ("F", "B", "I", "W"):
                value = costs.get((s, kind), costs.get(kind))
                if value is not None:
                    flat[f"{s}{kind}"] = value
        entries.append({"microbatch_size": float(meta.get("microbatch_size") or traced_microbatch(manifest)),
                        "costs": flat, "source": os.path.abspath(path),
                        **({"optimizer_s": meta["optimizer_s"]} if "optimizer_s" in meta else {})})
    return entries


def overhead_of(mode: str, value: float, step_s: float = 0.0) -> dict:
    """The ``overhead`` section for one fitted number: ``"delay"``: seconds added to every message (a receiver
    that is busy computing, on CPUs another process's time slice, takes that long to see it: idle time, which
    other work may fill); ``"busy"``: seconds of rank time per compute action and per comm op; ``"scale"``: the
    fraction by which every compute action of the run is slower than its measured cost (``compute_scale``)."""
    if mode == "delay":
        return {"compute_action_s": 0.0, "comm_op_s": 0.0, "message_delay_s": value, "step_s": step_s}
    if mode == "busy":
        return {"compute_action_s": value, "comm_op_s": value, "message_delay_s": 0.0, "step_s": step_s}
    if mode == "scale":
        return {"compute_action_s": 0.0, "comm_op_s": 0.0, "message_delay_s": 0.0, "compute_scale": value,
                "step_s": step_s}
    raise ValueError(f"overhead mode {mode!r}: use one of {', '.join(FIT_MODES)}")


def describe_overhead(mode: str, value: float) -> str:
    """The fitted number in words: "120 us per action", "900 us per message" or "+9.0% per compute action"."""
    if mode == "scale":
        return f"{value:+.1%} per compute action"
    return f"{value * 1e6:.0f} us " + ("per message" if mode == "delay" else "per action")


def fit_overheads(manifest: dict, calibration: Calibration, measured_step_s: float, precision: str = "fp32",
                  mode: str = None, tolerance: float = 1e-4) -> dict:
    """The one overhead number (``mode``, default :data:`FIT_MODE`, see :func:`overhead_of`) with which the
    predicted step of the folder's plan equals ``measured_step_s``; bisection (the prediction grows with it). A
    plan without messages cannot be fitted by a delay: then the per-action overhead is fitted instead."""
    mode = mode or FIT_MODE

    def predicted(value: float, how: str) -> float:
        calibration.overhead = overhead_of(how, value)
        return predict_folder(manifest, calibration, precision=precision).step_s

    base = predicted(0.0, mode)
    if base >= measured_step_s:
        # already slower without overheads: a negative per-step term where the gap is small (stage costs timed a
        # little slower in isolation); none where it is not, as such costs do not describe this run
        gap = measured_step_s - base
        result = overhead_of(mode, 0.0, gap if -gap <= MAX_NEGATIVE_STEP_FRACTION * measured_step_s else 0.0)
    else:
        if mode == "delay" and predicted(measured_step_s, mode) < measured_step_s:
            mode = "busy"
        low, high = 0.0, max(measured_step_s, 1e-6)
        while predicted(high, mode) < measured_step_s and high < 1e3:
            high *= 2
        while high - low > tolerance * max(low, 1e-9) and high - low > 1e-9:
            middle = (low + high) / 2
            if predicted(middle, mode) < measured_step_s:
                low = middle
            else:
                high = middle
        result = overhead_of(mode, (low + high) / 2)
    calibration.overhead = dict(result, mode=mode)
    value = {"delay": "message_delay_s", "busy": "compute_action_s", "scale": "compute_scale"}[mode]
    result.update(mode=mode, value=result[value],
                  unfitted_step_s=base, measured_step_s=measured_step_s)
    return result


def calibrate(out_dir: str, costs_paths: Optional[list] = None, comm_path: Optional[str] = None,
              nproc: Optional[int] = None, fit_steps: int = 12, fit: bool = True, skip_comm: bool = False,
              precision: str = "fp32", mode: Optional[str] = None, repeats: int = REPEATS, runtime: bool = True,
              paired_steps: Optional[int] = None, log=print) -> Calibration:
    """Measure and write ``OUT/calibration.json`` (see the module doc); returns what was written. ``paired_steps``:
    default :data:`PAIRED_STEPS` on CPU hosts, 0 where CUDA is available (each rank's meter holds a copy of every
    stage: on a GPU sized for its own stages that copy may not fit, and GPU timings do not drift as a shared CPU's)."""
    from tracepp.codegen.manifest import load_manifest

    manifest = load_manifest(out_dir)
    plan = manifest["plan"]
    layout = mesh_layout(plan)
    if layout.tp > 1:
        raise ValueError(f"{out_dir} was split with --tp {layout.tp}: calibrate the same split without --tp, then "
                         f"price tensor parallelism with `tracepp plan OUT --tune --tp-sizes 1,{layout.tp}` "
                         f"(docs/tensor-parallel.md)")
    if layout.cp > 1:
        raise ValueError(f"{out_dir} was split with --cp {layout.cp}: calibrate the same split without --cp, then "
                         f"price context parallelism with `tracepp plan OUT --tune --cp-sizes 1,{layout.cp}` "
                         f"(docs/context-parallel.md)")
    nproc = nproc or layout.pp * layout.dp
    calibration = Calibration(folder=folder_record(manifest))
    # 1. comm
    if comm_path:
        with open(comm_path) as handle:
            calibration.comm = json.load(handle)
        calibration.comm["source"] = os.path.abspath(comm_path)
    elif not skip_comm and nproc > 1:
        log(f"ping-pong between neighbouring ranks ({nproc} processes) ...")
        calibration.comm = measure_comm(nproc)
        calibration.comm["source"] = f"tracepp.costs.measure_comm, {nproc} local processes"
    for key, value in sorted((calibration.comm.get("pairs") or {}).items()):
        bandwidth = value.get("bandwidth_bytes_per_s")
        log(f"  ranks {key}: latency {value['latency_s'] * 1e6:.1f} us, bandwidth "
            + (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "n/a"))
    # 2. compute
    repeats = max(1, int(repeats))
    samples: list = []
    if costs_paths:
        calibration.compute = compute_entries(manifest, costs_paths)
    else:
        before = (repeats + 1) // 2 if fit else repeats
        log(f"stage costs: plain-autograd measurement of each stage ({before} of {repeats}"
            + (", the rest after the calibration run" if before < repeats else "") + ") ...")
        samples = [measured_stage_costs(out_dir) for _ in range(before)]
        _set_measured_compute(calibration, manifest, samples)
        if runtime:
            _set_runtime_factors(calibration, out_dir, log)
    for entry in calibration.compute:
        if "optimizer_s" in entry:
            calibration.optimizer_s = {str(k): float(v) for k, v in entry["optimizer_s"].items()}
    sizes = sorted({entry["microbatch_size"] for entry in calibration.compute})
    if len(sizes) < 2:
        calibration.notes.append("compute measured at one microbatch size: another microbatch count is priced as "
                                 "proportional to the microbatch size (give --costs files at two sizes to fit a "
                                 "fixed part)")
    # 3. overheads
    if fit:
        paired = None
        if paired_steps is None:
            import torch

            paired_steps = 0 if torch.cuda.is_available() else PAIRED_STEPS
        if paired_steps > 0:
            log(f"calibration run: {fit_steps} steps of {out_dir}/run.py on {nproc} processes, then {paired_steps} "
                f"(+1) with the stage costs measured in the run around each ...")
            times, paired = run_folder_paired(out_dir, fit_steps, nproc, paired_steps, len(manifest["stages"]))
            for error in paired["errors"]:
                log(f"  in-run stage costs: {error}")
        else:
            log(f"calibration run: {fit_steps} steps of {out_dir}/run.py on {nproc} processes ...")
            times = run_folder(out_dir, fit_steps, nproc)
        measured = statistics.median(times[WARMUP_STEPS:] or times)
        calibration.noise["run"] = interquartile_fraction(times[WARMUP_STEPS:])
        if samples and len(samples) < repeats:
            log(f"stage costs: {repeats - len(samples)} more measurement(s) after the calibration run ...")
            samples += [measured_stage_costs(out_dir) for _ in range(repeats - len(samples))]
            _set_measured_compute(calibration, manifest, samples)
        result = fit_overheads(manifest, calibration, measured, precision, mode)
        source = (f"fitted to {len(times[WARMUP_STEPS:] or times)} steps of this folder "
                  f"(median {measured * 1000:.1f} ms; {WARMUP_STEPS} warm-up steps dropped)")
        fits = fit_paired(manifest, calibration, paired, precision, result["mode"]) if paired else []
        per_step = [value for value, _step, _unfitted in fits]
        if per_step:  # each paired step and its own costs saw one spell of the machine: their fits are preferred
            result.update(overhead_of(result["mode"], statistics.median(per_step)), value=statistics.median(per_step))
            source = (f"the median of {len(per_step)} fits, one per paired step of this folder, each to the stage "
                      f"costs its ranks measured right before and after it (tracepp.costs.measure_in_run)")
            log(f"  paired steps: median {statistics.median(s for _v, s, _u in fits) * 1000:.1f} ms, simulated "
                f"without overheads with the costs measured around each: median "
                f"{statistics.median(u for _v, _s, u in fits) * 1000:.1f} ms")
        calibration.overhead = dict(overhead_of(result["mode"], result["value"], result["step_s"]), mode=result["mode"])
        calibration.overhead.update(source=source, measured_step_s=measured, unfitted_step_s=result["unfitted_step_s"],
                                    paired_fits=per_step)
        log(f"  measured step {measured * 1000:.1f} ms, simulated without overheads "
            f"{result['unfitted_step_s'] * 1000:.1f} ms: {describe_overhead(result['mode'], result['value'])}"
            + (f" (the median of {len(per_step)} paired steps' fits)" if per_step else "")
            + (f", {result['step_s'] * 1000:.1f} ms per step" if result["step_s"] else ""))
        if result["unfitted_step_s"] > measured * (1 + MAX_NEGATIVE_STEP_FRACTION):
            note = (f"the stage costs alone predict {result['unfitted_step_s'] * 1000:.1f} ms, more than the measured "
                    f"{measured * 1000:.1f} ms: they were not measured for this machine and load (overheads left 0)")
            calibration.notes.append(note)
            log(f"  warning: {note}")
    else:
        calibration.overhead = dict(overhead_of(FIT_MODE, 0.0), source="not fitted")
    _record_compute_noise(calibration, manifest, samples, log)
    _report_noise(calibration, log)
    path = write_calibration(out_dir, calibration)
    log(f"wrote {path}")
    return calibration


def _set_measured_compute(calibration: Calibration, manifest: dict, samples: list) -> None:
    """The ``compute`` section from repeated plain-autograd measurements: their median per key."""
    calibration.compute = [{"microbatch_size": traced_microbatch(manifest), "costs": median_costs(samples),
                            "source": f"tracepp.costs.measure_stages.measure_stage_costs, median of {len(samples)}"}]


def _record_compute_noise(calibration: Calibration, manifest: dict, samples: list, log=print) -> None:
    """``noise["compute"]``: the relative range of the plan's comm-free step priced with each repeat."""
    if len(samples) < 2:
        return
    steps = []
    for costs in samples:
        alone = Calibration(compute=[{"microbatch_size": traced_microbatch(manifest), "costs": dict(costs)}],
                            optimizer_s=calibration.optimizer_s, folder=calibration.folder, runtime=calibration.runtime)
        steps.append(predict_folder(manifest, alone).step_s)
    calibration.noise["compute"] = relative_range(steps)
    calibration.noise["compute_steps_s"] = steps
    log(f"  comm-free step priced with each measurement: {', '.join(f'{s * 1000:.1f}' for s in steps)} ms")


def _report_noise(calibration: Calibration, log=print) -> None:
    """Say how much the machine moved while it was measured, and warn (and note it in the file) above
    :data:`NOISE_WARNING`."""
    noise = calibration.noise
    parts = []
    if noise.get("compute") is not None:
        parts.append(f"stage costs {noise['compute']:.1%} across {len(noise.get('compute_steps_s') or [])} "
                     f"measurements")
    if noise.get("run") is not None:
        parts.append(f"calibration run steps {noise['run']:.1%} (interquartile)")
    if not parts:
        return
    worst = calibration.noise_fraction()
    log(f"  machine noise: {'; '.join(parts)}")
    if worst is not None and worst > NOISE_WARNING:
        note = (f"this machine's speed moved by {worst:.0%} while it was calibrated (more than "
                f"{NOISE_WARNING:.0%}): predictions are no closer than that; calibrate again on a quieter machine "
                f"(no other jobs, a fixed CPU frequency) for tighter ones")
        calibration.notes.append(note)
        log(f"  warning: {note}")
