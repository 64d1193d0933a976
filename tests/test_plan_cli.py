"""`tracepp plan` / `tracepp inspect` on a split folder, `--costs`, broken CSV plans and impossible
rank/stage/schedule combinations on the command line. No torchrun: these only trace, plan and print."""
import json
import os
import re
import xml.etree.ElementTree as ET

import pytest

from tracepp.cli import main as cli_main
from tracepp.runtime.actions import Action, Topology
from tracepp.codegen.csvio import dump_csv
from tracepp.codegen.plan import build_plan
from tracepp.codegen.simulate import simulate
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.runtime.run_options import RunOptions
from tracepp.codegen.manifest import load_manifest, topology_from_manifest
from util import model_path

FOUR_STAGES = "layers.1,layers.2,layers.3"
# "  0  0, 3  40  4.0%  4": rank, stages, actions, bubble, peak in-flight
ROW = re.compile(r"^\s*(\d+)\s+(\d+(?:, \d+)*)\s+(\d+)\s+([\d.]+)%\s+(\d+)\s*$", re.M)


@pytest.fixture(scope="module")
def zbv_out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("plan") / "out")
    split_model(model_path("tied_lm_v"), out, schedule="zbv", num_microbatches=4, layout=Layout(pp=2))
    return out


def _plan_parts(out):
    manifest = load_manifest(out)
    plan = manifest["plan"]
    actions = {int(r): [Action.parse(a) for a in acts] for r, acts in plan["actions"].items()}
    return manifest, plan, actions


def _simulated(out, costs=None):
    manifest, plan, actions = _plan_parts(out)
    return simulate(actions, plan["stage_to_rank"], topology_from_manifest(manifest), plan["num_microbatches"],
                    costs=costs)


def _check_table(text, sim, stage_to_rank, actions):
    rows = {int(m.group(1)): m.groups()[1:] for m in ROW.finditer(text)}
    assert sorted(rows) == [0, 1], text
    for rank, (stages, count, bubble, peak) in rows.items():
        assert stages == ", ".join(str(s) for s, r in enumerate(stage_to_rank) if r == rank)
        assert int(count) == len(actions[rank])
        assert bubble == f"{sim.bubble[rank] * 100:.1f}"
        assert int(peak) == sim.peak_inflight[rank]


def _grid_columns(text):
    """rank -> the actions in its grid column, top to bottom (cells sliced at the header's column offsets)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("step") and "rank 0 (stages" in line)
    left, right = lines[head].index("rank 0"), lines[head].index("rank 1")
    columns = {0: [], 1: []}
    for line in lines[head + 2:]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        for rank, cell in ((0, line[left:right]), (1, line[right:])):
            if cell.strip():
                columns[rank].append(cell.strip())
    return columns


def test_plan_prints_grid_bubble_peak_and_writes_pictures(zbv_out, capsys):
    manifest, plan, actions = _plan_parts(zbv_out)
    assert cli_main(["plan", zbv_out]) == 0
    text = capsys.readouterr().out
    sim = _simulated(zbv_out)
    assert "schedule zbv (v placement): 2 ranks, 4 stages, 4 microbatches" in text
    _check_table(text, sim, plan["stage_to_rank"], actions)
    assert "rank 0 (stages 0,3)" in text and "rank 1 (stages 1,2)" in text
    columns = _grid_columns(text)
    for rank in (0, 1):
        assert columns[rank] == [str(a) for a in actions[rank] if not a.is_comm], f"rank {rank} grid"
    assert f"makespan {sim.makespan:g}" in text and "unit costs" in text
    compute = [a for r in actions for a in actions[r] if not a.is_comm]
    # the SVG: valid XML, one titled box per compute action
    svg = ET.parse(os.path.join(zbv_out, "plan.svg")).getroot()
    assert svg.tag.endswith("svg")
    titles = [t.text for t in svg.iter() if t.tag.endswith("title")]
    assert sorted(t.split(" ")[0] for t in titles) == sorted(map(str, compute))
    # the Chrome trace: one X event per compute action, on its rank's pid
    trace = json.load(open(os.path.join(zbv_out, "plan_trace.json")))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in events) == sorted(
        (r, str(a)) for r in actions for a in actions[r] if not a.is_comm)
    assert f"wrote {os.path.join(zbv_out, 'plan.svg')}" in text


def test_plan_costs_drive_the_picture(zbv_out, tmp_path, capsys):
    costs_path = tmp_path / "measured.json"
    costs_path.write_text(json.dumps({"F": 1.5, "B": 4.0, "3F": 5.0}))
    svg, trace_path = str(tmp_path / "p.svg"), str(tmp_path / "p.json")
    assert cli_main(["plan", zbv_out, "--costs", str(costs_path), "--svg", svg, "--trace", trace_path]) == 0
    text = capsys.readouterr().out
    expected = {"F": 1.5, "B": 4.0, "I": 2.0, "W": 2.0, (3, "F"): 5.0}  # B without I/W: each half B/2
    sim = _simulated(zbv_out, expected)
    assert sim.makespan != _simulated(zbv_out).makespan
    assert f"makespan {sim.makespan:g}" in text and "measured costs" in text
    _, plan, actions = _plan_parts(zbv_out)
    _check_table(text, sim, plan["stage_to_rank"], actions)
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e["ph"] == "X"]
    durations = {(e["args"]["stage"], e["args"]["kind"]): e["dur"] for e in events}
    assert durations[(0, "F")] == 1500 and durations[(3, "F")] == 5000
    assert durations[(1, "I")] == 2000 and durations[(1, "W")] == 2000
    ET.parse(svg)


@pytest.mark.parametrize("content,needle", [
    ('{"X": 1}', "key 'X' is not an action kind"),
    ('{"7F": 1}', "names stage 7, but the plan has stages 0..3"),
    ('{"F": -1}', "times must be positive numbers"),
    ("[1, 2]", "expected a non-empty JSON object"),
    ("{F: 1}", "not valid JSON"),
])
def test_plan_bad_costs_exit_2(zbv_out, tmp_path, capsys, content, needle):
    costs_path = tmp_path / "bad.json"
    costs_path.write_text(content)
    assert cli_main(["plan", zbv_out, "--costs", str(costs_path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "tracepp plan: error: --costs" in err


def test_inspect_prints_stages_bubble_peak_and_grid(zbv_out, capsys):
    _, plan, actions = _plan_parts(zbv_out)
    sim = _simulated(zbv_out)
    assert cli_main(["inspect", zbv_out]) == 0
    text = capsys.readouterr().out
    assert "embed.weight, head.weight" in text  # the shared-parameter table
    _check_table(text, sim, plan["stage_to_rank"], actions)
    assert "rank 0 (stages 0,3)" not in text  # the grid only with --grid
    assert cli_main(["inspect", zbv_out, "--grid"]) == 0
    text = capsys.readouterr().out
    _check_table(text, sim, plan["stage_to_rank"], actions)
    columns = _grid_columns(text)
    assert columns[1] == [str(a) for a in actions[1] if not a.is_comm]


def test_rank_script_of_a_v_plan_is_readable(zbv_out):
    source = open(os.path.join(zbv_out, "rank0.py")).read()
    compile(source, "rank0.py", "exec")
    assert "stage(s) 0, 3 of 4" in source and "zbv (v placement)" in source
    assert "Shared parameter embed.weight = head.weight: stages 0, 3 use one tensor on this rank" in source
    assert "def stage0_forward(\n    " in source and "def stage3_forward(\n    " in source
    assert not [line for line in source.splitlines() if line != line.rstrip()], "trailing whitespace"
    body = source.split("ACTIONS = [\n", 1)[1].split("\n]", 1)[0]
    for line in body.splitlines():  # one compute action per line, with its receives before and sends after
        cells = [Action.parse(c.strip().strip('"')) for c in line.strip().rstrip(",").split(",")]
        assert sum(not a.is_comm for a in cells) == 1, line
        compute = next(i for i, a in enumerate(cells) if not a.is_comm)
        assert all(a.kind.startswith("RECV") for a in cells[:compute]), line
        assert all(a.kind.startswith("SEND") for a in cells[compute + 1:]), line


# ------------------------------------------------------------------------------------------ broken CSVs

def _zbv_compute(training=True):
    plan = build_plan("zbv", 2, 4, 4, Topology.chain(4), training)
    return {r: [a for a in acts if not a.is_comm] for r, acts in plan.actions.items()}


def _split_csv(tmp_path, compute, capsys, microbatches=4):
    csv_path = str(tmp_path / "plan.csv")
    dump_csv(compute, csv_path)
    out = str(tmp_path / "out")
    code = cli_main(["split", model_path("residual_mlp_lm"), "-o", out, "--ranks", "2", "--schedule", csv_path,
                     "--microbatches", str(microbatches), "--split-points", FOUR_STAGES])
    err = capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "manifest.json")), "a bad plan must write nothing"
    return code, err


def test_csv_missing_input_grad_names_its_weight_grad(tmp_path, capsys):
    compute = _zbv_compute()
    compute[1].remove(Action(1, "I", 0))
    w_pos = compute[1].index(Action(1, "W", 0))
    code, err = _split_csv(tmp_path, compute, capsys)
    assert code == 2, err
    assert f"plan.csv: rank 1, action {w_pos} '1W0': weight-grad W before the input-grad '1I0'; put '1I0' " \
           f"earlier on rank 1" in err


def test_csv_missing_backward_another_stage_of_the_rank_needs(tmp_path, capsys):
    """Rank 1 holds stages 1 and 2 (V): 1I0 needs 2's gradient in memory, and 2I0 is gone."""
    compute = _zbv_compute()
    compute[1].remove(Action(2, "I", 0))
    pos = compute[1].index(Action(1, "I", 0))
    code, err = _split_csv(tmp_path, compute, capsys)
    assert code == 2, err
    assert f"rank 1, action {pos} '1I0': needs '2B0' or '2I0' first, which rank 1 never runs" in err


def test_csv_backward_before_its_local_input(tmp_path, capsys):
    compute = _zbv_compute()
    late = compute[1].index(Action(2, "I", 0))
    early = compute[1].index(Action(1, "I", 0))
    compute[1][late], compute[1][early] = compute[1][early], compute[1][late]
    early, late = sorted((early, late))
    code, err = _split_csv(tmp_path, compute, capsys)
    assert code == 2, err
    assert f"rank 1, action {early} '1I0': needs '2I0' (action {late}) to run first; move it before action " \
           f"{early}" in err


def test_csv_missing_full_backward(tmp_path, capsys):
    plan = build_plan("interleaved-1f1b", 2, 4, 4, Topology.chain(4))
    compute = {r: [a for a in acts if not a.is_comm and str(a) != "2B1"] for r, acts in plan.actions.items()}
    code, err = _split_csv(tmp_path, compute, capsys)
    assert code == 2, err
    assert "stage 2 microbatch 1 has no backward: add '2B1' (or '2I1' and '2W1') to rank 0" in err


def test_csv_duplicated_forward(tmp_path, capsys):
    compute = _zbv_compute()
    compute[1].insert(5, compute[1][0])
    code, err = _split_csv(tmp_path, compute, capsys)
    assert code == 2, err
    assert f"rank 1, action 5 '{compute[1][0]}': duplicate F of stage {compute[1][0].stage} microbatch " \
           f"{compute[1][0].mb} (first at rank 1, action 0" in err


def test_csv_wrong_microbatch_count(tmp_path, capsys):
    code, err = _split_csv(tmp_path, _zbv_compute(), capsys, microbatches=2)
    assert code == 2, err
    assert "microbatch 2 out of range (2 microbatches: 0..1); check --microbatches" in err


# ------------------------------------------------------------------------------------------ bad combos

@pytest.mark.parametrize("flags,message", [
    (["--stages", "4", "--schedule", "1f1b"],
     "schedule '1f1b' runs one stage per rank; got 4 stages on 2 ranks: use --schedule interleaved-1f1b or "
     "--stages 2"),
    (["--stages", "3", "--schedule", "interleaved-1f1b"],
     "3 stages cannot be spread evenly over 2 ranks: use --stages a multiple of --ranks 2 (e.g. --stages 2 or 4)"),
    (["--stages", "6", "--schedule", "zbv"],
     "schedule 'zbv' runs exactly 2 stages per rank (a V); got 6 stages on 2 ranks: use --stages 4"),
    (["--stages", "3", "--schedule", "plan.csv"],
     "3 stages cannot be spread evenly over 2 ranks: use --stages a multiple of --ranks 2 (e.g. --stages 2 or 4)"),
    (["--split-points", "layers.1,layers.2", "--schedule", "interleaved-1f1b"],
     "3 stages cannot be spread evenly over 2 ranks: use --stages a multiple of --ranks 2 (e.g. --stages 2 or 4)"),
])
def test_impossible_layouts_exit_2(tmp_path, capsys, flags, message):
    out = str(tmp_path / "out")
    code = cli_main(["split", model_path("residual_mlp_lm"), "-o", out, "--ranks", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("tracepp split: error: ") and not os.path.exists(out)


def test_inspect_shows_flop_estimates(tmp_path, capsys):
    """Per-stage forward FLOPs (counted on fake tensors at split time) appear in the stage table and feed a
    second bubble estimate."""
    from tracepp.cli import main as cli_main
    from tracepp.driver import split_model
    from util import REPO

    out = str(tmp_path / "out")
    manifest = split_model(os.path.join(REPO, "examples", "gpt.py"), out, num_microbatches=4, layout=Layout(pp=2),
                           run=RunOptions(optimizer="adamw"))
    flops = [stage["forward_flops"] for stage in manifest["stages"]]
    # two transformer blocks per stage, batch 2 x seq 32 x d 64: the matmuls alone are over 10 MFLOP
    assert all(f and f > 10e6 for f in flops)
    assert cli_main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "fwd MFLOP/mb" in text and f"{flops[0] / 1e6:,.1f}" in text
    assert "with FLOP-estimated costs" in text
    # the split-time estimates: time from FLOPs, memory held under 1F1B (stage 0 keeps 2 microbatches in flight)
    estimates = [stage["estimate"] for stage in manifest["stages"]]
    assert [e["inflight_microbatches"] for e in estimates] == [2, 1]
    for e in estimates:  # AdamW's two fp32 states of fp32 parameters, and a step count per tensor
        assert 2 * e["param_bytes"] <= e["optimizer_bytes"] <= 2 * e["param_bytes"] + 4096
        assert e["memory_bytes"] == (e["param_bytes"] + e["grad_bytes"] + e["optimizer_bytes"]
                                     + e["activation_bytes_per_microbatch"] * e["inflight_microbatches"])
    step_flops = [e["step_flops_per_microbatch"] for e in estimates]
    memory = [e["memory_bytes"] for e in estimates]
    time_imbalance = max(step_flops) / (sum(step_flops) / 2)
    memory_imbalance = max(memory) / (sum(memory) / 2)
    assert f"imbalance (max/mean): time {time_imbalance:.2f}, memory {memory_imbalance:.2f}" in text
    # every boundary value is listed as sent, every recomputed one as recomputed
    sent = [line.split()[0] for line in text.splitlines() if line.endswith(" sent")]
    assert sent == list(manifest["values"])


def test_resplit_keeps_user_files_and_drops_stale_ranks(tmp_path, capsys):
    """Re-running `tracepp split -o out` replaces only what the earlier split wrote: the README's
    `out/trained.pt` survives, a rank script the new plan no longer has is gone, a foreign folder is refused."""
    out = str(tmp_path / "out")
    model = model_path("residual_mlp_lm")
    assert cli_main(["split", model, "-o", out, "--ranks", "4", "--split-points", FOUR_STAGES]) == 0
    with open(os.path.join(out, "trained.pt"), "w") as handle:
        handle.write("the user's checkpoint")
    assert cli_main(["split", model, "-o", out, "--ranks", "2"]) == 0
    assert open(os.path.join(out, "trained.pt")).read() == "the user's checkpoint"
    assert os.path.exists(os.path.join(out, "rank1.py")) and not os.path.exists(os.path.join(out, "rank2.py"))
    manifest = load_manifest(out)
    assert "trained.pt" not in manifest["files"] and "rank0.py" in manifest["files"]
    assert "rank3.py" not in manifest["files"] and not os.path.exists(os.path.join(out, "weights"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert cli_main(["split", model, "-o", str(foreign), "--ranks", "2"]) == 2
    assert "has no tracepp manifest.json; choose another -o" in capsys.readouterr().err
    assert os.listdir(foreign) == ["notes.txt"]


def test_tune_prices_sequence_parallelism_and_apply_splits_with_it(tmp_path, capsys):
    """`plan --tune --tp-sizes 1,2` lists tp 2 with and without sequence parallelism (the `sp` column); under a
    memory limit only sequence parallelism meets, `--apply` re-splits with `--tp 2 --sequence-parallel`. Made-up
    stage costs, free comms: no process runs."""
    out = str(tmp_path / "out")
    split_model(model_path("tp_llama"), out, schedule="1f1b", num_microbatches=2, split_points=["layers.2"],
                layout=Layout(pp=2))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}))
    assert cli_main(["calibrate", out, "--costs", str(costs), "--no-comm", "--no-fit"]) == 0
    search = ["plan", out, "--tune", "--schedules", "1f1b", "--microbatch-counts", "2", "--tp-sizes", "1,2"]
    capsys.readouterr()
    assert cli_main(search) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit() and "1f1b" in line]
    # #, schedule, stages, (k/rank), M, tp, sp, split points, step ms, bubble, peak MB per rank (a / b)
    peak = {(row[5], row[6]): max(float(row[-3]), float(row[-1])) for row in rows}
    assert set(peak) == {("1", "-"), ("2", "no"), ("2", "yes")}
    assert peak[("2", "yes")] < peak[("2", "no")] < peak[("1", "-")]
    limit = (peak[("2", "yes")] + peak[("2", "no")]) / 2
    assert cli_main(search + ["--memory-limit", f"{limit:.4f}MB", "--apply"]) == 0
    assert "--tp 2 --sequence-parallel" in capsys.readouterr().out
    manifest = load_manifest(out)
    assert manifest["plan"]["mesh"]["tp"] == 2 and manifest["plan"]["mesh"]["sequence_parallel"] is True
    assert manifest["tp"]["sequence_parallel"]["sent"] == {"layers_1_out": 1}


def test_tune_prices_ep_sizes_and_apply_splits_with_the_chosen_ep(tmp_path, capsys):
    """`plan --tune --ep-sizes 1,2` on the zoo Mixtral at `--dp 2` lists ep 1 and ep 2 (the `ep` column); ep 2
    holds the experts' weights, gradients and optimizer state in halves where FSDP keeps them gathered through the
    step, so under a limit between the two only ep 2 fits and `--apply` re-splits with `--ep 2`; an ep size that
    does not divide --dp is refused with the sizes that do. Made-up stage costs, free comms: no process runs."""
    import os

    out = str(tmp_path / "out")
    zoo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo", "mixtral.py")
    split_model(zoo, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2, dp=2))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"0F": 1.0, "0B": 2.0, "1F": 1.0, "1B": 2.0}))
    assert cli_main(["calibrate", out, "--costs", str(costs), "--no-comm", "--no-fit"]) == 0
    search = ["plan", out, "--tune", "--schedules", "1f1b", "--microbatch-counts", "2", "--ep-sizes", "1,2"]
    capsys.readouterr()
    assert cli_main(search) == 0
    text = capsys.readouterr().out
    assert " ep " in text.splitlines()[0]
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit() and "1f1b" in line]
    # #, schedule, stages, (k/rank), M, tp, sp, ep, split points, step ms, bubble, peak MB per rank (a / b)
    peak = {row[7]: max(float(row[-3]), float(row[-1])) for row in rows}
    assert set(peak) == {"1", "2"} and peak["2"] < peak["1"]
    assert cli_main(search[:-1] + ["1,4"]) == 2
    assert "--ep-sizes 4: an ep size must divide --dp 2" in capsys.readouterr().err
    limit = (peak["1"] + peak["2"]) / 2
    assert cli_main(search + ["--memory-limit", f"{limit:.4f}MB", "--apply"]) == 0
    assert "--ep 2" in capsys.readouterr().out
    manifest = load_manifest(out)
    assert manifest["plan"]["mesh"]["ep"] == 2 and manifest["ep"]["size"] == 2
    assert all(entry["local"][0] == 2 for entry in manifest["ep"]["params"].values())  # 4 experts over 2 ranks
    # other ep sizes on the folder split with --ep 2: refused by the plan alone, before any tuner figure is computed
    import tracepp.tuner_figures

    def no_figures(*_args, **_kwargs):
        raise AssertionError("tuner figures computed before the --ep-sizes refusal")

    original, tracepp.tuner_figures.ensure = tracepp.tuner_figures.ensure, no_figures
    try:
        capsys.readouterr()
        assert cli_main(search) == 2
    finally:
        tracepp.tuner_figures.ensure = original
    assert "--ep-sizes 1,2: this folder was split with --ep 2" in capsys.readouterr().err
