"""The calibrated simulator: ``out/calibration.json`` and the predicted step time of a plan.

``tracepp calibrate out/`` (``tracepp.costs.calibrate``) writes the file; ``tracepp plan``, the tuner
(``tracepp.costs.search``) and the benchmark read it. It holds what the replay engine (``runtime.replay``) needs to
time a plan in seconds, measured on the machine that will run it:

* ``comm``: per neighbouring rank pair, the latency and bandwidth of one message (a ping-pong with the
  runtime's own calls, ``tracepp.costs.measure_comm``), and whether the backend's p2p ops complete in FIFO order per
  rank (NCCL, ``serial``) or independently (gloo);
* ``compute``: per stage, the seconds of one microbatch's F, B, I and W (the ``--costs`` format of
  ``tracepp.costs.costs_file``), at one or more microbatch sizes; with two or more sizes each (stage, kind) is
  a line ``a + c x size`` (least squares), with one the time is taken as proportional to the size;
* ``optimizer_s``: per stage, the optimizer step's seconds (optional);
* ``runtime``: per kind (F, B, I, W), how much longer tracepp's executor takes for a stage than its function
  alone, measured in one process (``factors``; the simulator multiplies the compute costs by them);
* ``overhead``: what the runtime adds on top in a real run: seconds per compute action, per comm op posted, and
  per step (fitted to a short run of the folder, see ``tracepp.costs.calibrate``);
* ``noise``: how much this machine's speed varied while it was measured: ``compute`` is the relative range
  ((max - min) / median) of the plan's comm-free step priced with each repeat of the stage-cost measurement,
  ``run`` the interquartile range over the median of the calibration run's steps. A prediction cannot be
  trusted closer than the larger of the two (:meth:`Calibration.noise_fraction`); ``tracepp plan`` prints it.

The step time predicted for a plan is the replay's end of each rank (its last compute, or its last transfer:
a rank waits on its sends at the end of a step), plus the rank's optimizer step, the largest over ranks, plus
the per-step overhead. Plain data and the standard library only.

Another split (the tuner's candidates): each measured stage's time is attributed to the segments it holds
(the manifest's ``segments``: repeated blocks and top-level modules) in proportion to their forward FLOPs,
and a candidate stage costs the sum of its segments'. Boundary messages of a cut are the tensors that cross
it (``cut_bytes``), scaled with the microbatch size.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Optional

CALIBRATION_FILE = "calibration.json"
FORMAT = 1
KINDS = ("F", "B", "I", "W")
W_AFTER_I = "W_after_I"  # a W right after its own I: its own runtime factor (``runtime.replay.W_AFTER_I``, the same)
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
               "float8_e5m2": 1}
WIRE_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Calibration:
    """The contents of ``calibration.json`` (see the module doc)."""

    comm: dict = field(default_factory=dict)  # {"backend", "serial", "pairs": {"0-1": {latency_s, bandwidth_bytes_per_s}}}
    compute: list = field(default_factory=list)  # [{"microbatch_size": b, "costs": {"0F": s, ...}, "source": text}]
    optimizer_s: dict = field(default_factory=dict)  # {"0": s, ...} per stage
    overhead: dict = field(default_factory=dict)  # {"compute_action_s", "comm_op_s", "step_s", "source"}
    folder: dict = field(default_factory=dict)  # the split it was measured on: stages, FLOPs, microbatch size
    notes: list = field(default_factory=list)
    noise: dict = field(default_factory=dict)  # {"compute": fraction, "run": fraction, ...} (see module doc)
    runtime: dict = field(default_factory=dict)  # {"factors": {"F": x, "B": x, "I": x, "W": x}, "source": text}

    def to_json(self) -> dict:
        return {"format": FORMAT, "comm": self.comm, "compute": self.compute, "optimizer_s": self.optimizer_s,
                "overhead": self.overhead, "folder": self.folder, "notes": self.notes, "noise": self.noise,
                "runtime": self.runtime}

    @classmethod
    def from_json(cls, data: dict, path: str = "calibration.json") -> "Calibration":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not a tracepp calibration file of format {FORMAT}; write it again with "
                             f"`tracepp calibrate OUT`")
        return cls(dict(data.get("comm") or {}), list(data.get("compute") or []), dict(data.get("optimizer_s") or {}),
                   dict(data.get("overhead") or {}), dict(data.get("folder") or {}), list(data.get("notes") or []),
                   dict(data.get("noise") or {}), dict(data.get("runtime") or {}))

    # -- what the simulator reads ---------------------------------------------------------------------------
    def link(self, rank_a: int, rank_b: int) -> tuple:
        """(latency s, bandwidth bytes/s or None) of a rank pair: its own entry, else the pairs' median."""
        pairs = self.comm.get("pairs") or {}
        entry = pairs.get(f"{min(rank_a, rank_b)}-{max(rank_a, rank_b)}")
        if entry is None and pairs:
            ordered = sorted(pairs.values(), key=lambda e: e["latency_s"])
            entry = ordered[len(ordered) // 2]
        if entry is None:
            return (0.0, None)
        bandwidth = entry.get("bandwidth_bytes_per_s")
        return (float(entry["latency_s"]), float(bandwidth) if bandwidth and math.isfinite(bandwidth) else None)

    def stage_cost_lines(self) -> dict:
        """{(stage, kind): (a, c)}: seconds = a + c x microbatch size, from the compute samples (see module doc)."""
        samples: dict = {}
        for entry in self.compute:
            size = float(entry["microbatch_size"])
            for key, seconds in entry["costs"].items():
                stage, kind = int(key[:-1]), key[-1]
                samples.setdefault((stage, kind), []).append((size, float(seconds)))
        lines = {}
        for key, points in samples.items():
            lines[key] = _line(points)
        for (stage, kind) in list(lines):  # a full backward priced by its halves where it was not measured
            if kind == "I" and (stage, "B") not in lines and (stage, "W") in lines:
                (a1, c1), (a2, c2) = lines[(stage, "I")], lines[(stage, "W")]
                lines[(stage, "B")] = (a1 + a2, c1 + c2)
        for (stage, kind) in list(lines):  # and split halves from a full backward: equal halves
            if kind == "B" and (stage, "I") not in lines:
                a, c = lines[(stage, "B")]
                lines[(stage, "I")] = lines[(stage, "W")] = (a / 2, c / 2)
        return lines

    def stage_costs(self, microbatch_size: float) -> dict:
        """{(stage, kind): seconds} of the measured split at ``microbatch_size`` samples per microbatch."""
        return {key: max(a + c * microbatch_size, 0.0) for key, (a, c) in self.stage_cost_lines().items()}

    def overheads(self) -> tuple:
        """(seconds per compute action, per comm op, per step)."""
        o = self.overhead
        return (float(o.get("compute_action_s", 0.0)), float(o.get("comm_op_s", 0.0)), float(o.get("step_s", 0.0)))

    def noise_fraction(self) -> Optional[float]:
        """The larger of the recorded spreads (``noise``: compute repeats, calibration run), or None if neither was
        measured: how close to a measured step a prediction from this calibration can be expected to come."""
        values = [float(v) for key, v in self.noise.items() if key in ("compute", "run") and v is not None]
        return max(values) if values else None

    def runtime_factors(self) -> dict:
        """{kind: factor}: how much longer tracepp's executor takes for a stage's F, B, I or W than the stage
        function alone (measured in one process, ``tracepp.costs.measure_stages.measure_runtime_costs``); 1 where not
        measured. ``W_after_I`` (where measured): a W run right after its own I, against the same plain W."""
        factors = self.runtime.get("factors") or {}
        found = {kind: float(factors.get(kind, 1.0)) for kind in KINDS}
        if W_AFTER_I in factors:
            found[W_AFTER_I] = float(factors[W_AFTER_I])
        return found

    def runtime_costs(self, costs: dict) -> dict:
        """``{(stage, kind): s}`` of the stage functions alone -> what the runtime takes for them
        (:meth:`runtime_factors`), with a ``(stage, "W_after_I")`` entry per W where that factor was measured
        (the simulator prices a W that directly follows its own I with it: ``runtime.replay.cost_of``)."""
        factors = self.runtime_factors()
        scale = 1.0 + float(self.overhead.get("compute_scale", 0.0))  # the fitted "scale" overhead, if any
        priced = {(stage, kind): seconds * factors.get(kind, 1.0) * scale for (stage, kind), seconds in costs.items()}
        if W_AFTER_I in factors:
            priced.update({(stage, W_AFTER_I): seconds * factors[W_AFTER_I] * scale
                           for (stage, kind), seconds in costs.items() if kind == "W"})
        return priced

    def message_delay(self) -> float:
        """Seconds added to every message in the run beyond the ping-pong's (fitted, see ``tracepp.costs.calibrate``)."""
        return float(self.overhead.get("message_delay_s", 0.0))


def _line(points: list) -> tuple:
    """Least squares ``seconds = a + c x size`` with a >= 0 and c >= 0; one size: proportional (a = 0)."""
    sizes = {size for size, _ in points}
    if len(sizes) < 2:
        size = points[0][0]
        mean = sum(t for _, t in points) / len(points)
        return (0.0, mean / size if size else 0.0)
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    c = sum((x - mx) * (y - my) for x, y in points) / var
    a = my - c * mx
    if c < 0:  # time that falls with size is noise: a constant
        return (my, 0.0)
    if a < 0:  # no negative fixed part: proportional through the origin
        return (0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))
    return (a, c)


def runtime_factors(plain: dict, runtime: dict, floor: float = 1e-5) -> dict:
    """{kind: median over stages of runtime / plain seconds} for F, B, I and W, from two ``{"0F": s, ...}``
    measurements of the same stages (the stage functions alone, and through tracepp's executor). A stage whose
    time of that kind is below ``floor`` in either (a first stage's I: nothing to compute) is left out; a kind
    no stage has is absent. ``runtime`` may also hold ``"0W_after_I"``: a W timed right after its own I,
    compared with the same plain W."""
    ratios: dict = {}
    for key, other in runtime.items():
        match = re.fullmatch(r"(\d+)(\w+)", key)
        if match is None or match.group(2) not in KINDS + (W_AFTER_I,):
            continue
        stage, kind = match.groups()
        seconds = plain.get(stage + ("W" if kind == W_AFTER_I else kind))
        if seconds is None or seconds < floor or other < floor:
            continue
        ratios.setdefault(kind, []).append(float(other) / float(seconds))
    return {kind: statistics.median(ratios[kind]) for kind in KINDS + (W_AFTER_I,) if kind in ratios}


def relative_range(values: list) -> Optional[float]:
    """(max - min) / median of ``values`` (None for fewer than two, or a median of 0)."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return None
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median > 0 else None


def interquartile_fraction(values: list) -> Optional[float]:
    """(third quartile - first quartile) / median of ``values`` (None for fewer than four)."""
    values = sorted(float(v) for v in values)
    if len(values) < 4:
        return None
    first, median, third = statistics.quantiles(values, n=4, method="inclusive")
    return (third - first) / median if median > 0 else None


def median_costs(samples: list) -> dict:
    """Per key, the median over several measurements of the same ``{"0F": s, ...}`` costs."""
    keys = sorted({key for costs in samples for key in costs})
    return {key: statistics.median([costs[key] for costs in samples if key in costs]) for key in keys}


def load_calibration(path: str) -> Calibration:
    if os.path.isdir(path):
        path = os.path.join(path, CALIBRATION_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: write it with `tracepp calibrate OUT`, or add --calibrate to "
                                f"`tracepp plan OUT` (see docs/calibration.md)")
    with open(path) as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}); write it again with `tracepp calibrate OUT`") from None
    return Calibration.from_json(data, path)


def write_calibration(path: str, calibration: Calibration) -> str:
    if os.path.isdir(path):
        path = os.path.join(path, CALIBRATION_FILE)
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(calibration.to_json(), handle, indent=1)
    os.replace(temporary, path)
    return path


# ----------------------------------------------------------------------------------------------------
# what a folder's plan moves and holds

def traced_microbatch(manifest: dict) -> float:
    """Samples per microbatch of the folder's own plan (the shapes in its manifest are for this size)."""
    return manifest["batch_size"] / manifest["plan"]["num_microbatches"]


def _numel(shape: list, symbols: dict) -> int:
    from tracepp.runtime.shapes import compile_shape

    count = 1
    for dim in compile_shape(shape)(symbols):
        count *= int(dim)
    return count


def _symbol_values(manifest: dict, microbatch_size: float) -> dict:
    values = {}
    for name, info in (manifest.get("symbols") or {}).items():
        if name == manifest.get("batch_symbol"):
            values[name] = max(1, int(round(microbatch_size)))
        else:  # another dynamic dim: its largest declared size, else its smallest
            values[name] = info.get("max") or info.get("min") or 1
    return values


def message_bytes(manifest: dict, microbatch_size: Optional[float] = None, precision: str = "fp32") -> dict:
    """{(producer stage, consumer stage, "F" or "B"): (tensors, bytes)} per microbatch of ``microbatch_size``
    samples (default: the folder's own), from the manifest's boundary values: their shapes (symbols bound to
    the microbatch), their dtypes, or ``precision``'s wire dtype for floating tensors. "B" counts the values
    that carry a gradient back."""
    traced = traced_microbatch(manifest)
    size = traced if microbatch_size is None else microbatch_size
    symbols = _symbol_values(manifest, size)
    # a shape without the batch symbol is the traced microbatch's: scale it
    scale_static = size / traced if traced else 1.0
    wire = WIRE_DTYPES.get(precision)
    out: dict = {}
    for value in manifest["values"].values():
        dtype = value["dtype"]
        if wire and dtype in ("float32", "float64", "float16", "bfloat16"):
            dtype = wire
        numel = _numel(value["shape"], symbols)
        dynamic = manifest.get("batch_symbol") and any(manifest["batch_symbol"] in str(d) for d in value["shape"])
        size_bytes = numel * DTYPE_BYTES.get(dtype, 4) * (1.0 if dynamic else scale_static)
        for consumer in value["consumers"]:
            directions = ("F", "B") if value.get("requires_grad") else ("F",)
            for direction in directions:
                tensors, total = out.get((value["producer"], consumer, direction), (0, 0.0))
                out[(value["producer"], consumer, direction)] = (tensors + 1, total + size_bytes)
    return out


def comm_model(calibration: Calibration, stage_to_rank: list, messages: dict):
    """The replay engine's CommModel for a plan: the calibrated links between the ranks it uses, its messages,
    the calibrated overheads."""
    from tracepp.runtime.replay import CommModel

    ranks = sorted(set(stage_to_rank))
    links = {(a, b): calibration.link(a, b) for a in ranks for b in ranks if a < b}
    compute_s, op_s, _step_s = calibration.overheads()
    serial = bool(calibration.comm.get("serial", calibration.comm.get("backend") == "nccl"))
    return CommModel(links=links, default=calibration.link(0, 1) if calibration.comm.get("pairs") else (0.0, None),
                     messages=messages, compute_overhead=compute_s, op_overhead=op_s, serial=serial,
                     message_delay=calibration.message_delay())


@dataclass
class Prediction:
    """A plan's predicted step: ``step_s`` (what ``run.py --metrics`` reports), the replay's ``makespan_s`` and
    ``bubble``, per rank its end, its optimizer seconds, its busy seconds."""

    step_s: float
    makespan_s: float
    bubble: float
    ends: dict
    optimizer_s: dict
    busy: dict
    sim: object = None

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "makespan_s": self.makespan_s, "bubble": self.bubble,
                "ends": {str(r): v for r, v in self.ends.items()},
                "optimizer_s": {str(r): v for r, v in self.optimizer_s.items()}}


def predict_plan(actions: dict, stage_to_rank: list, topology, num_microbatches: int, costs: dict,
                 calibration: Calibration, messages: dict, optimizer_stage_s: Optional[dict] = None,
                 training: bool = True, check: bool = True) -> Prediction:
    """Time a lowered plan (``{rank: [Action]}``) with the calibrated simulator (see the module doc);
    ``check=False`` for a plan the planner has just made (validated there)."""
    from tracepp.codegen.simulate import simulate

    model = comm_model(calibration, stage_to_rank, messages)
    sim = simulate(actions, stage_to_rank, topology, num_microbatches, costs=calibration.runtime_costs(costs),
                   training=training, comm=model, check=check)
    optimizer_stage_s = optimizer_stage_s or {}
    optimizer = {r: sum(float(optimizer_stage_s.get(s, 0.0)) for s, owner in enumerate(stage_to_rank) if owner == r)
                 for r in sim.timeline}
    _compute_s, _op_s, step_s = calibration.overheads()
    ends = {r: sim.ends.get(r, 0.0) for r in sim.timeline}
    step = max(ends[r] + optimizer[r] for r in sim.timeline) + step_s
    return Prediction(step, sim.makespan, sim.bubble_overall, ends, optimizer, sim.busy, sim)


def predict_folder(manifest: dict, calibration: Calibration, costs: Optional[dict] = None,
                   precision: str = "fp32") -> Prediction:
    """The predicted step time of a folder's own plan. ``costs`` (``{(stage, kind): s}``) override the
    calibration's compute samples (e.g. the costs measured for this very folder)."""
    from tracepp.codegen.manifest import topology_from_manifest
    from tracepp.runtime.actions import Action

    plan = manifest["plan"]
    actions = {int(rank): [Action.parse(a) for a in acts] for rank, acts in plan["actions"].items()}
    size = traced_microbatch(manifest)
    optimizer = {int(s): float(v) for s, v in calibration.optimizer_s.items()}
    if costs is None:
        try:
            check_matches(calibration, manifest)
            costs = calibration.stage_costs(size)
        except ValueError:  # another split of the same model (e.g. after the tuner's --apply): price by segment
            stages = stage_of_segments(manifest)
            costs = split_costs(calibration, stages, size) if stages and same_model(calibration, manifest) else None
            if costs is None:
                raise
            optimizer = split_optimizer(calibration, stages)
    return predict_plan(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                        costs, calibration, message_bytes(manifest, size, precision), optimizer,
                        manifest["training"])


def folder_record(manifest: dict) -> dict:
    """What a calibration records of the split it measured (to tell whether it applies to another folder)."""
    plan = manifest["plan"]
    return {"num_stages": len(manifest["stages"]), "stage_flops": [s.get("forward_flops") for s in manifest["stages"]],
            "microbatch_size": traced_microbatch(manifest), "batch_size": manifest["batch_size"],
            "schedule": plan["schedule"], "num_ranks": plan["num_ranks"], "num_microbatches": plan["num_microbatches"],
            "model_sha256": manifest.get("model_sha256"),
            "segments_per_stage": _segments_per_stage(manifest), "segments": manifest.get("segments") or []}


def _segments_per_stage(manifest: dict):
    stages = [seg.get("stage") for seg in manifest.get("segments") or []]
    if not stages or any(s is None for s in stages):
        return None
    return [stages.count(s) for s in range(len(manifest["stages"]))]


def check_matches(calibration: Calibration, manifest: dict) -> None:
    """A calibration's compute costs are per stage of the split it measured: refuse another split (another
    microbatch count of the same split is fine)."""
    record = calibration.folder
    if not record:
        return
    same = record.get("num_stages") == len(manifest["stages"])
    mine, theirs = _segments_per_stage(manifest), record.get("segments_per_stage")
    if same and mine and theirs:
        same = mine == theirs
    elif same and record.get("stage_flops"):
        flops = [s.get("forward_flops") or 0 for s in manifest["stages"]]
        recorded = [f or 0 for f in record["stage_flops"]]
        total, total_recorded = sum(flops), sum(recorded)
        if total and total_recorded:
            same = all(abs(a / total - b / total_recorded) < 0.01 for a, b in zip(flops, recorded))
    if not same:
        raise ValueError(f"the calibration was measured on another split ({record.get('num_stages')} stages) than "
                         f"this folder's ({len(manifest['stages'])} stages); calibrate this folder "
                         f"(`tracepp calibrate {manifest.get('_folder', 'OUT')}`), or use the tuner "
                         f"(`tracepp plan OUT --tune`), which prices other splits from the calibrated one")


# ----------------------------------------------------------------------------------------------------
# other splits of the same model: costs per segment

SEGMENT_WEIGHT_FLOOR = 0.01  # a segment without counted FLOPs (an embedding, a norm) weighs 1% of the largest


def segment_lines(calibration: Calibration) -> Optional[list]:
    """Per segment of the calibrated split, ``{kind: (a, c)}`` (seconds = a + c x microbatch size): each measured
    stage's line shared among its segments in proportion to their forward FLOPs (a floor of
    :data:`SEGMENT_WEIGHT_FLOOR` of the largest). None when the calibration has no segment table or its stages do
    not begin at segment boundaries (split markers inside a block)."""
    segments = calibration.folder.get("segments") or []
    num_stages = calibration.folder.get("num_stages")
    stages = [seg.get("stage") for seg in segments]
    if not segments or any(s is None for s in stages) or stages != sorted(stages) or \
            sorted(set(stages)) != list(range(num_stages or 0)):
        return None
    lines = calibration.stage_cost_lines()
    largest = max([seg["forward_flops"] or 0 for seg in segments] + [1])
    weights = [max(seg["forward_flops"] or 0, SEGMENT_WEIGHT_FLOOR * largest) for seg in segments]
    totals = {}
    for stage, weight in zip(stages, weights):
        totals[stage] = totals.get(stage, 0.0) + weight
    out = []
    for stage, weight in zip(stages, weights):
        share = weight / totals[stage]
        out.append({kind: (a * share, c * share) for (s, kind), (a, c) in lines.items() if s == stage})
    return out


def split_costs(calibration: Calibration, stage_of_segment: list, microbatch_size: float) -> Optional[dict]:
    """{(stage, kind): seconds} of a split given as the stage of each calibrated segment, or None (see
    :func:`segment_lines`)."""
    lines = segment_lines(calibration)
    if lines is None or len(lines) != len(stage_of_segment):
        return None
    costs: dict = {}
    for stage, per_kind in zip(stage_of_segment, lines):
        for kind, (a, c) in per_kind.items():
            costs[(stage, kind)] = costs.get((stage, kind), 0.0) + max(a + c * microbatch_size, 0.0)
    return costs


def split_optimizer(calibration: Calibration, stage_of_segment: list) -> dict:
    """{stage: seconds} of the optimizer step for a split: each measured stage's shared by parameter count."""
    segments = calibration.folder.get("segments") or []
    measured = {int(k): float(v) for k, v in calibration.optimizer_s.items()}
    if not measured or len(segments) != len(stage_of_segment):
        return {}
    params = {}
    for seg in segments:
        params[seg.get("stage")] = params.get(seg.get("stage"), 0) + (seg.get("num_params") or 0)
    out: dict = {}
    for seg, stage in zip(segments, stage_of_segment):
        total = params.get(seg.get("stage")) or 0
        share = (seg.get("num_params") or 0) / total if total else 0.0
        out[stage] = out.get(stage, 0.0) + measured.get(seg.get("stage"), 0.0) * share
    return out


def stage_of_segments(manifest: dict) -> Optional[list]:
    """The stage of each segment in a folder's own split, or None (no segment table, or stages that do not begin
    at segment boundaries)."""
    stages = [seg.get("stage") for seg in manifest.get("segments") or []]
    if not stages or any(s is None for s in stages) or stages != sorted(stages):
        return None
    return stages


def same_model(calibration: Calibration, manifest: dict) -> bool:
    """Was the calibration measured on a split of this model (same file, same segment table)?"""
    record = calibration.folder
    mine = [seg.get("begins") for seg in manifest.get("segments") or []]
    theirs = [seg.get("begins") for seg in record.get("segments") or []]
    return bool(mine) and mine == theirs and record.get("model_sha256") == manifest.get("model_sha256")
