"""The calibrated simulator against the measured step, and the tuner's pick against the hand-picked cases.

Used by ``benchmarks/run.py`` (every case gets ``prediction``: predicted step, measured median, error) and runnable
on the JSON of a finished suite to recompute the predictions:

    python -m benchmarks.predict RESULTS.json

How a case is predicted (``tracepp.costs.model``): its own plan, replayed with its stages' compute costs (the
plain-autograd measurement ``tracepp.costs.measure_stages`` inside each tracepp run, ``tracepp.costs.measure_in_run``; without it,
the plain costs ``benchmarks/stage_times.py`` measures in one process after the runs) times the runtime factors
(per kind, tracepp's executor over the plain stage function, from the same alternating rounds:
``runtime_section``, as ``tracepp calibrate`` measures them), the
ping-pong's latency and bandwidth per rank pair on each boundary message (gloo: ops independent), the optimizer
step per stage, and the one number ``tracepp calibrate`` fits to a measured run (``tracepp.costs.calibrate.FIT_MODE``:
a fixed time per action by default), never fitted to the case it
predicts: for each case it is the median of the values fitted to each *other* case of the suite of the same model
(leave one out), or of the other models' cases for a model with one case (the Mixtral case: nothing fitted to it). A
case with paired steps (``stepwise_pairs``) is fitted once per paired step, to the costs measured around it, and
its value is the median of those fits. A suite of one case cannot do that and
says so (``"fitted": true``: its "prediction" is then the fit itself).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys

def loadavg() -> list:
    """The 1, 5 and 15-minute load averages (Linux), or [] where /proc/loadavg does not exist."""
    try:
        with open("/proc/loadavg") as handle:
            return [float(x) for x in handle.read().split()[:3]]
    except OSError:
        return []


def _keyed(costs: dict) -> dict:
    """"0,F" or "0F" keys -> (0, "F") ("0,W_after_I" or "0W_after_I" -> (0, "W_after_I"))."""
    out = {}
    for key, value in costs.items():
        stage, kind = key.split(",") if "," in key else re.fullmatch(r"(\d+)(\w+)", key).groups()
        out[(int(stage), kind)] = float(value)
    return out


def _calibration(manifest: dict, costs: dict, optimizer_stage_s: dict, comm: dict, overhead: dict,
                 runtime: dict = None):
    from tracepp.costs.model import Calibration, folder_record, traced_microbatch

    return Calibration(comm=dict(comm or {}), optimizer_s={str(k): v for k, v in (optimizer_stage_s or {}).items()},
                       compute=[{"microbatch_size": traced_microbatch(manifest),
                                 "costs": {f"{s}{k}": v for (s, k), v in costs.items()}}],
                       overhead=dict(overhead or {}), folder=folder_record(manifest), runtime=dict(runtime or {}))


def runtime_section(entry: dict) -> dict:
    """The calibration's ``runtime`` section for a case, as ``tracepp calibrate`` measures it: the runtime factors
    of the case's own stage costs through tracepp's executor (``ideal.executor_costs``) over the plain ones, both
    from the same alternating rounds (``benchmarks/stage_times.py``); {} where the executor was not timed."""
    from tracepp.costs.model import runtime_factors

    ideal = entry.get("ideal") or {}
    # the plain costs of stage_times' own rounds ("costs_stage_times" once the suite priced the ideal with the
    # per-round costs instead): a ratio of two measurements minutes apart follows the machine, not the runtime
    plain, executor = ideal.get("costs_stage_times") or ideal.get("costs"), ideal.get("executor_costs")
    if not plain or not executor:
        return {}
    flat = lambda costs: {key.replace(",", ""): value for key, value in costs.items()}  # noqa: E731
    return {"factors": runtime_factors(flat(plain), flat(executor)), "source": "benchmarks/stage_times.py"}


def stepwise_pairs(entry: dict) -> list:
    """``[(costs, measured step)]`` for every paired step of a case's tracepp runs (``paired_runs``, see
    ``tracepp.costs.measure_in_run``): the step's time and the per-key mean of the plain-autograd stage costs its own ranks
    measured right before and right after it (a second apart, under the run's load), so a simulated step priced
    with them sees the same spell of the machine as the step it is compared with."""
    from tracepp.costs.measure_in_run import bracketed

    return [pair for paired in entry.get("paired_runs") or [] for pair in bracketed(paired)]


def case_noise(entry: dict):
    """How far this machine moved during a case: the larger of the relative ranges ((max - min) / median) of the
    tracepp rounds' median steps and of the ideal priced with each round's stage costs (None with one round). A
    prediction error inside it cannot be told from the noise."""
    from tracepp.costs.model import relative_range

    spreads = [relative_range((entry.get(key) or {}).get("round_step_s") or []) for key in ("tracepp", "ideal")]
    spreads = [s for s in spreads if s is not None]
    return max(spreads) if spreads else None


def predict_cases(entries: list, comm: dict, log=print, mode: str = None) -> None:
    """Add ``prediction`` to every entry that has a tracepp folder, measured step and stage costs (see module doc).
    Each entry needs ``out_dir``, ``tracepp.step_time_s``, ``compute_costs`` and ``optimizer_stage_s``."""
    from tracepp.costs.calibrate import FIT_MODE, describe_overhead, fit_overheads, fit_paired, overhead_of
    from tracepp.costs.model import predict_folder
    from tracepp.codegen.manifest import load_manifest

    mode = mode or FIT_MODE
    usable = [e for e in entries if e.get("compute_costs") and (e.get("tracepp") or {}).get("status") == "ok"]
    runtimes = {entry["case"]: runtime_section(entry) for entry in usable}
    pairs = {entry["case"]: stepwise_pairs(entry) for entry in usable}
    fitted = {}
    for entry in usable:
        manifest = load_manifest(entry["out_dir"])
        calibration = _calibration(manifest, _keyed(entry["compute_costs"]), entry.get("optimizer_stage_s"), comm, {},
                                   runtimes[entry["case"]])
        fitted[entry["case"]] = fit_overheads(manifest, calibration, entry["tracepp"]["step_time_s"], mode=mode)
        # with paired steps, the case's own fit is the median of one fit per paired step, each to the costs
        # measured around that step: the step and its costs see the same spell of the machine, where the median
        # step and the rounds' costs came from spells up to minutes apart
        per_step = [value for paired in entry.get("paired_runs") or []
                    for value, _step, _unfitted in fit_paired(manifest, calibration, paired, mode=mode)]
        if per_step:
            fitted[entry["case"]].update(mode=mode, value=statistics.median(per_step), per_step=len(per_step))
    for entry in usable:
        manifest = load_manifest(entry["out_dir"])
        # leave one out among the cases of the same model; a model with one case (the suite's Mixtral) takes the
        # other models' fits, i.e. is predicted with nothing fitted to it
        pool = [e for e in usable if e["case"] != entry["case"] and fitted[e["case"]]["mode"] == mode]
        same_model = [e for e in pool if (e.get("model") or {}).get("name") == (entry.get("model") or {}).get("name")]
        others = [fitted[e["case"]]["value"] for e in (same_model or pool)]
        own = fitted[entry["case"]]
        used_mode = mode if others else own["mode"]
        value = statistics.median(others) if others else own["value"]
        overhead = overhead_of(used_mode, value)
        keyed = _keyed(entry["compute_costs"])
        runtime = runtimes[entry["case"]]
        step = predict_folder(manifest, _calibration(manifest, keyed, entry.get("optimizer_stage_s"), comm,
                                                     overhead, runtime)).step_s
        free = predict_folder(manifest, _calibration(manifest, keyed, entry.get("optimizer_stage_s"), {}, {},
                                                     runtime)).step_s
        measured = entry["tracepp"]["step_time_s"]
        noise = case_noise(entry)
        # each paired step against the simulator priced with the costs measured around it (same overhead)
        stepwise = [predict_folder(manifest, _calibration(manifest, _keyed(costs), entry.get("optimizer_stage_s"),
                                                          comm, overhead, runtime)).step_s / step - 1
                    for costs, step in pairs[entry["case"]]]
        entry["prediction"] = {"status": "ok", "step_time_s": step, "measured_step_s": measured, "noise": noise,
                               "error": (step - measured) / measured, "overhead": overhead,
                               "overhead_mode": used_mode, "overhead_s": value, "fitted_overhead_s": own["value"],
                               "fitted_overhead_mode": own["mode"], "fitted_per_step": own.get("per_step", 0),
                               "no_overhead_step_s": own["unfitted_step_s"], "comm_free_step_s": free,
                               "fitted": not others, "costs_source": entry.get("costs_source"),
                               "runtime_factors": runtime.get("factors", {}),
                               "stepwise_errors": stepwise,
                               "error_stepwise": statistics.median(stepwise) if stepwise else None}
        log(f"  {entry['case']}: predicted {step * 1000:.1f} ms, measured {measured * 1000:.1f} ms "
            f"({(step - measured) / measured:+.1%}"
            + (f"; rounds moved {noise:.0%}" if noise is not None else "")
            + (f"; per paired step {statistics.median(stepwise):+.1%}" if stepwise else "")
            + f"); {describe_overhead(used_mode, value)} "
            f"({'own fit' if not others else 'median of the other cases'}; own fit "
            f"{describe_overhead(own['mode'], own['value'])})")


def suite_calibration(entries: list, comm: dict, overhead: dict):
    """A calibration of the quick suite's model for the tuner: the cases that share one split (the 2-stage
    ones, at their several microbatch sizes) give the compute samples and the runtime factors (their median);
    ``overhead`` (the fitted number, as :func:`tracepp.costs.calibrate.overhead_of` spells it); the comm."""
    from tracepp.costs.model import Calibration, folder_record, traced_microbatch
    from tracepp.codegen.manifest import load_manifest

    by_stages: dict = {}
    for entry in entries:
        if entry.get("compute_costs"):
            by_stages.setdefault(entry["stages"], []).append(entry)
    if not by_stages:
        return None, None
    stages = max(by_stages, key=lambda s: (len({e["microbatches"] for e in by_stages[s]}), -s))
    group = sorted(by_stages[stages], key=lambda e: e["microbatches"])
    reference = group[0]
    manifest = load_manifest(reference["out_dir"])
    compute = []
    for entry in group:
        other = load_manifest(entry["out_dir"])
        compute.append({"microbatch_size": traced_microbatch(other),
                        "costs": {f"{s}{k}": v for (s, k), v in _keyed(entry["compute_costs"]).items()},
                        "source": entry["case"]})
    per_kind: dict = {}  # the group's runtime factors: per kind, the median over its cases
    for entry in group:
        for kind, value in runtime_section(entry).get("factors", {}).items():
            per_kind.setdefault(kind, []).append(value)
    runtime = {"factors": {kind: statistics.median(values) for kind, values in per_kind.items()},
               "source": "median over " + ", ".join(e["case"] for e in group)} if per_kind else {}
    calibration = Calibration(comm=dict(comm or {}), compute=compute,
                              optimizer_s={str(k): v for k, v in (reference.get("optimizer_stage_s") or {}).items()},
                              overhead=dict(overhead), folder=folder_record(manifest), runtime=runtime)
    return calibration, reference["out_dir"]


def main(argv=None) -> int:
    """Recompute the predictions of a results JSON whose work folder was kept (``--keep``)."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as handle:
        report = json.load(handle)
    entries = [e for e in report["results"] if e.get("out_dir") and os.path.isdir(e["out_dir"])]
    predict_cases(entries, report.get("comm") or {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
