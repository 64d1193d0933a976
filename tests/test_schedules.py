"""Schedule planning: generators, lowering, validation, simulation, CSV, visualization, build_plan."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tracepp.runtime.actions import Action, Topology
from tracepp.codegen.csvio import dump_csv, load_csv, resolve_peers
from tracepp.codegen.lower import lower
from tracepp.codegen.plan import SchedulePlan, build_plan
from tracepp.codegen.schedules import SCHEDULES, generate, placement
from tracepp.codegen.simulate import ScheduleError, simulate, validate
from tracepp.codegen.visualize import format_grid, write_chrome_trace, write_svg

A = Action.parse


def acts(*texts):
    return [A(t) for t in texts]


def plan_for(schedule, ranks, stages, mbs, topology=None, training=True):
    topology = topology or Topology.chain(stages)
    st = placement(schedule, ranks, stages)
    lowered = lower(generate(schedule, ranks, stages, mbs, training, topology=topology), st, topology, training)
    return st, topology, lowered


def sim(schedule, ranks, stages, mbs, costs=None):
    st, top, lowered = plan_for(schedule, ranks, stages, mbs)
    return simulate(lowered, st, top, mbs, costs)


# ------------------------------------------------------------------------------------------ grid

STAGES_PER_RANK = {"gpipe": (1,), "1f1b": (1,), "interleaved-1f1b": (1, 2, 3, 4), "looped-bfs": (1, 2, 4),
                   "interleaved-zb": (1, 2, 3), "zbv": (2,), "dualpipev": (2,)}


def _grid():
    for schedule in SCHEDULES:
        for ranks in (1, 2, 3, 4, 5, 8):
            for v in STAGES_PER_RANK[schedule]:
                mbs = sorted({1, ranks - 1, ranks, ranks + 1, 2 * ranks + 1, 3 * ranks} - {0})
                if ranks == 4:
                    mbs.append(32)
                for m in mbs:
                    yield schedule, ranks, v, m


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grid_lowered_plans_validate(schedule):
    checked = 0
    for name, ranks, v, m in _grid():
        if name != schedule:
            continue
        if name.startswith("interleaved") and v > 1 and m < ranks:
            with pytest.raises(ValueError, match="at least as many microbatches as ranks"):
                generate(name, ranks, ranks * v, m)
            continue
        for training in (True, False):
            st, top, lowered = plan_for(name, ranks, ranks * v, m, training=training)
            validate(lowered, st, top, m, training)
            kinds = {a.kind for r in lowered.values() for a in r if not a.is_comm}
            assert kinds <= ({"F", "B", "I", "W"} if training else {"F"})
            checked += 1
    assert checked > 10


def test_interleaved_any_microbatch_count():
    for ranks in (2, 3, 4):
        for m in range(ranks, 3 * ranks + 2):
            st, top, lowered = plan_for("interleaved-1f1b", ranks, 2 * ranks, m)
            validate(lowered, st, top, m)


# ------------------------------------------------------------------------------------------ placement / rejection

def test_placement_styles():
    assert placement("1f1b", 4, 4) == [0, 1, 2, 3]
    assert placement("interleaved-1f1b", 2, 6) == [0, 1, 0, 1, 0, 1]
    assert placement("zbv", 3, 6) == [0, 1, 2, 2, 1, 0]
    assert placement("dualpipev", 2, 4) == [0, 1, 1, 0]


@pytest.mark.parametrize("schedule,ranks,stages,pattern", [
    ("1f1b", 2, 4, r"schedule '1f1b' runs one stage per rank; got 4 stages on 2 ranks: use --schedule "
                   r"interleaved-1f1b or --stages 2"),
    ("gpipe", 4, 2, r"one stage per rank; got 2 stages on 4 ranks"),
    ("zbv", 2, 6, r"'zbv' runs exactly 2 stages per rank .* got 6 stages on 2 ranks: use --stages 4"),
    ("dualpipev", 4, 4, r"exactly 2 stages per rank"),
    ("interleaved-1f1b", 2, 5, r"5 stages cannot be spread evenly over 2 ranks: use --stages a multiple of --ranks 2 "
                               r"\(e.g. --stages 4 or 6\)"),
])
def test_placement_rejections_are_clear(schedule, ranks, stages, pattern):
    with pytest.raises(ValueError, match=pattern):
        placement(schedule, ranks, stages)


def test_rejections_and_unknown_names():
    with pytest.raises(ValueError, match=r"'interleaved-zb' needs at least as many microbatches as ranks; "
                                         r"got 2 microbatches on 4 ranks: use --microbatches 4"):
        generate("interleaved-zb", 4, 8, 2)
    with pytest.raises(ValueError, match="valid schedules: gpipe, 1f1b"):
        generate("pipedream", 2, 2, 2)
    with pytest.raises(ValueError, match="valid schedules: gpipe, 1f1b"):
        build_plan("nope", 2, 2, 2, Topology.chain(2))


# ------------------------------------------------------------------------------------------ simulation

@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_bubble_formulas(p, k):
    m = k * p  # unit costs F=1, B=2
    for schedule in ("gpipe", "1f1b"):
        assert sim(schedule, p, p, m).bubble_overall == pytest.approx((p - 1) / (m + p - 1))
    for v in (2, 3, 4):
        assert sim("interleaved-1f1b", p, v * p, m).bubble_overall == pytest.approx((p - 1) / (v * m + p - 1))


def test_1f1b_peak_inflight():
    for p in (1, 2, 4, 8):
        for m in (1, 2, p, 3 * p):
            res = sim("1f1b", p, p, m)
            assert res.peak_inflight == {r: min(p - r, m) for r in range(p)}


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_zero_bubble_beats_1f1b(p, k):
    # cost model: every stage action costs F=1, I=1, W=1, full B=2 (the simulator's defaults)
    m = k * p
    base = sim("1f1b", p, p, m).bubble_overall
    for schedule, stages in (("interleaved-zb", p), ("interleaved-zb", 2 * p), ("zbv", 2 * p),
                             ("dualpipev", 2 * p)):
        assert sim(schedule, p, stages, m).bubble_overall < base, (schedule, stages)


def test_simulate_costs_and_result():
    res = sim("1f1b", 2, 2, 4, costs={"F": 2.0, "B": 3.0})
    assert res.makespan == pytest.approx(4 * 5 + 5)
    res2 = sim("1f1b", 2, 2, 4, costs={(0, "F"): 2.0, (1, "F"): 2.0, "B": 3.0})
    assert res2.makespan == res.makespan
    assert set(res.timeline) == {0, 1}
    for r, tl in res.timeline.items():
        assert all(e > s for _, s, e in tl)
        assert res.busy[r] == pytest.approx(20)


# ------------------------------------------------------------------------------------------ lowering

def test_skip_connection_topology():
    edges = ((0, 1), (1, 2), (0, 2))
    top = Topology(3, edges, edges)
    for schedule in ("gpipe", "1f1b", "interleaved-zb", "looped-bfs"):
        plan = build_plan(schedule, 3, 3, 5, top)
        flat = [a for r in plan.actions.values() for a in r]
        assert A("0SEND_F2>2") in flat and A("2RECV_F2<0") in flat
        assert A("2SEND_B2>0") in flat and A("0RECV_B2<2") in flat


def test_v_placement_keeps_same_rank_edges_local():
    for schedule in ("zbv", "dualpipev"):
        st, top, lowered = plan_for(schedule, 3, 6, 6)
        for r, lst in lowered.items():
            for a in lst:
                if a.is_comm:
                    assert st[a.peer] != r
        # stages 2 and 3 share rank 2: nothing goes between them
        assert not [a for a in lowered[2] if a.is_comm and {a.stage, a.peer} == {2, 3}]
        assert not [a for a in lowered[0] if a.is_comm and {a.stage, a.peer} == {5, 0}]


def test_lower_is_idempotent_and_local_edges_silent():
    st, top, lowered = plan_for("interleaved-1f1b", 2, 4, 4)
    assert lower(lowered, st, top) == lowered
    # one rank: no comm at all
    st, top, lowered = plan_for("interleaved-1f1b", 1, 3, 3)
    assert not [a for a in lowered[0] if a.is_comm]


def test_lower_places_send_after_and_recv_before():
    st, top, lowered = plan_for("1f1b", 3, 3, 6)
    for r, lst in lowered.items():
        pos = {a: i for i, a in enumerate(lst)}
        for a in lst:
            if a.kind == "SEND_F":
                assert lst[pos[a] - 1] == Action(a.stage, "F", a.mb) or lst[pos[a] - 1].is_comm
                assert pos[Action(a.stage, "F", a.mb)] < pos[a]
            if a.kind == "RECV_F":
                assert pos[a] < pos[Action(a.stage, "F", a.mb)]
            if a.kind == "RECV_B":
                assert pos[a] < pos[Action(a.stage, "B", a.mb)]


# ------------------------------------------------------------------------------------------ validation

def _gpipe2():
    """gpipe, 2 ranks, 2 microbatches, lowered by hand."""
    return {
        0: acts("0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0B0", "0RECV_B1<1", "0B1"),
        1: acts("1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1", "1B0", "1SEND_B0>0", "1B1", "1SEND_B1>0"),
    }


CHAIN2 = Topology.chain(2)


def test_hand_plan_is_valid():
    validate(_gpipe2(), [0, 1], CHAIN2, 2)


def _expect(plan, pattern, m=2, st=(0, 1), top=CHAIN2):
    with pytest.raises(ScheduleError, match=pattern):
        validate(plan, list(st), top, m)


def test_validate_missing_recv():
    plan = _gpipe2()
    plan[1].remove(A("1RECV_F0<0"))
    _expect(plan, r"rank 1, action 0 '1F0': its input from stage 0 \(RECV_F '1RECV_F0<0'\) has not arrived")


def test_validate_missing_send():
    plan = _gpipe2()
    plan[0].remove(A("0SEND_F1>1"))
    _expect(plan, r"'1RECV_F1<0': no matching '0SEND_F1>1' on rank 0")


def test_validate_duplicate_f():
    plan = _gpipe2()
    plan[0].insert(3, A("0F1"))
    _expect(plan, r"rank 0, action 3 '0F1': duplicate F of stage 0 microbatch 1")


def test_validate_w_before_i():
    st, top, lowered = plan_for("zbv", 2, 4, 4)
    lst = next(actions for actions in lowered.values() if any(a.kind == "I" for a in actions))
    i = next(k for k, a in enumerate(lst) if a.kind == "I")
    w = lst.index(A(f"{lst[i].stage}W{lst[i].mb}"))
    name_i, name_w = str(lst[i]), str(lst[w])
    lst[i], lst[w] = lst[w], lst[i]
    with pytest.raises(ScheduleError, match=rf"'{name_w}': weight-grad W before the input-grad '{name_i}'; "
                                            rf"put '{name_i}' earlier"):
        validate(lowered, st, top, 4)


def test_validate_missing_backward_and_wrong_rank():
    plan = _gpipe2()
    plan[0].remove(A("0B1"))
    _expect(plan, r"stage 0 microbatch 1 has no backward")
    plan = _gpipe2()
    plan[1].append(A("0F1"))
    _expect(plan, r"rank 1, action 8 '0F1': stage 0 lives on rank 0, not rank 1")


def test_validate_mismatched_pair_order():
    plan = _gpipe2()
    plan[1] = acts("1RECV_F1<0", "1RECV_F0<0", "1F0", "1F1", "1B0", "1SEND_B0>0", "1B1", "1SEND_B1>0")
    _expect(plan, r"rank pair 0->1: send #0 on rank 0 is '0SEND_F0>1' .* receive #0 on rank 1 is '1RECV_F1<0'")


def test_validate_deadlock():
    plan = {
        0: acts("0F0", "0SEND_F0>1", "0F1", "0RECV_B0<1", "0B0", "0SEND_F1>1", "0RECV_B1<1", "0B1"),
        1: acts("1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1", "1B0", "1SEND_B0>0", "1B1", "1SEND_B1>0"),
    }
    _expect(plan, r"deadlock: rank 0 waits at action 3 '0RECV_B0<1' \(rank 1 has not reached '1SEND_B0>0'\), "
                  r"rank 1 waits at action 2 '1RECV_F1<0' \(rank 0 has not reached '0SEND_F1>1'\)")


def test_validate_fifo_deadlock():
    # data dependencies alone are fine (gloo would run it), but rank 0's comm stream holds '0RECV_B0<1'
    # ahead of '0SEND_F1>1', and rank 1 needs microbatch 1 before it can produce that gradient
    plan = {
        0: acts("0F0", "0SEND_F0>1", "0F1", "0RECV_B0<1", "0F2", "0SEND_F1>1", "0SEND_F2>1", "0B0",
                "0RECV_B1<1", "0B1", "0RECV_B2<1", "0B2"),
        1: acts("1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1", "1B0", "1SEND_B0>0", "1RECV_F2<0", "1F2", "1B1",
                "1SEND_B1>0", "1B2", "1SEND_B2>0"),
    }
    _expect(plan, r"deadlock: rank 0 waits at action 3 '0RECV_B0<1'.*rank 1 waits at action 2 '1RECV_F1<0'",
            m=3)


# ------------------------------------------------------------------------------------------ CSV

def test_csv_round_trip(tmp_path):
    for schedule, stages in (("1f1b", 3), ("zbv", 6), ("interleaved-zb", 6)):
        st, top, lowered = plan_for(schedule, 3, stages, 5)
        path = tmp_path / f"{schedule}.csv"
        dump_csv(lowered, path)
        assert load_csv(path) == lowered
        compute = generate(schedule, 3, stages, 5)
        dump_csv(compute, path)
        assert load_csv(path) == compute


def test_csv_torch_style_peers(tmp_path):
    path = tmp_path / "torch.csv"
    path.write_text("0F0,0SEND_F0,,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
                    "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1,\n")
    plan = build_plan(str(path), 2, 2, 2, CHAIN2)
    assert plan.placement == "csv" and plan.stage_to_rank == [0, 1]
    assert plan.actions == _gpipe2()


def test_csv_errors(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X1\n")
    with pytest.raises(ValueError, match=r"row 0 \(rank 0\), column 1: cannot parse '0X1'"):
        load_csv(path)
    skip = Topology(3, ((0, 1), (0, 2), (1, 2)), ((0, 1), (0, 2), (1, 2)))
    with pytest.raises(ValueError, match=r"rank 0, action 1 '0SEND_F0': cannot resolve the peer: stage 0 has 2"):
        resolve_peers({0: acts("0F0", "0SEND_F0")}, skip)
    path.write_text("0F0,1F0\n1B0\n")
    with pytest.raises(ValueError, match="stage 1 appears on rank 0 .* and on rank 1"):
        build_plan(str(path), 2, 2, 1, CHAIN2)


def test_csv_compute_only_plan(tmp_path):
    path = tmp_path / "mine.csv"
    dump_csv(generate("zbv", 2, 4, 4), path)
    plan = build_plan(str(path), 2, 4, 4, Topology.chain(4))
    assert plan.stage_to_rank == [0, 1, 1, 0]
    validate(plan.actions, plan.stage_to_rank, Topology.chain(4), 4)


# ------------------------------------------------------------------------------------------ planning / viz

def test_build_plan_json_round_trip():
    for schedule, stages in (("gpipe", 4), ("interleaved-1f1b", 8), ("dualpipev", 8)):
        plan = build_plan(schedule, 4, stages, 8, Topology.chain(stages))
        d = json.loads(json.dumps(plan.to_json()))
        assert SchedulePlan.from_json(d) == plan
    fwd = build_plan("zbv", 2, 4, 3, Topology.chain(4), training=False)
    assert {a.kind for r in fwd.actions.values() for a in r} == {"F", "SEND_F", "RECV_F"}
    assert fwd.placement == "v"


def test_visualize(tmp_path):
    plan = build_plan("interleaved-zb", 2, 4, 4, Topology.chain(4))
    grid = format_grid(plan.actions, plan.stage_to_rank)
    assert "rank 0 (stages 0,2)" in grid and "0F0" in grid and "SEND" not in grid
    assert "SEND_F" in format_grid(plan.actions, compute_only=False)
    res = simulate(plan.actions, plan.stage_to_rank, Topology.chain(4), 4)
    svg = tmp_path / "t.svg"
    write_svg(res, svg)
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg") and len(root.findall(".//{http://www.w3.org/2000/svg}rect")) > 16
    trace = tmp_path / "t.json"
    write_chrome_trace(res, trace)
    events = json.loads(trace.read_text())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == sum(len(tl) for tl in res.timeline.values())
    assert {e["pid"] for e in xs} == {0, 1}


def _assert_every_split_left_is_needed(plan, s2r, top, steps):
    """Fusing any I + W pair that ``plan`` keeps adjacent makes its unit-cost step longer than ``steps``."""
    from tracepp.codegen import schedules
    from tracepp.runtime.replay import replay

    for r, i in schedules._adjacent_splits(plan):
        trial = dict(plan)
        trial[r] = schedules._fused(plan[r], {i})
        assert replay(trial, s2r, top).makespan > steps, (r, str(plan[r][i]))


@pytest.mark.parametrize("ranks,stages,m", [(1, 2, 3), (2, 4, 4), (2, 4, 8), (3, 6, 5), (4, 8, 8), (8, 16, 32)])
def test_interleaved_zb_keeps_a_split_only_where_it_shortens_the_step(ranks, stages, m):
    """A split backward whose W runs right after its I only sends the input gradient a W earlier: interleaved-zb
    makes it one full backward wherever the unit-cost step stays as short (the runtime's split costs a graph walk
    and a second pass over the weights' inputs). Every kept split is needed: fusing it lengthens the step. The
    largest plan (over the replay budget) gets the first pass only: fusions that move no action's start."""
    from tracepp.codegen import schedules
    from tracepp.runtime.replay import replay

    s2r, top = placement("interleaved-zb", ranks, stages), Topology.chain(stages)
    unfused = schedules._orders("interleaved-zb", ranks, stages, m, s2r, top, training=True)
    plan = generate("interleaved-zb", ranks, stages, m)
    steps = replay(unfused, s2r, top).makespan
    assert replay(plan, s2r, top).makespan == steps
    validate(lower(plan, s2r, top), s2r, top, m)
    fused = sum(a.kind == "B" for actions in plan.values() for a in actions)
    kept = schedules._adjacent_splits(plan)
    assert fused + len(kept) == stages * m  # every backward is a B or a split whose W follows its I at once
    if ranks == 1:
        assert not kept  # nothing waits for a gradient on one rank
        return
    assert fused > 0 and kept
    if ranks == 8:
        return
    _assert_every_split_left_is_needed(plan, s2r, top, steps)  # the greedy pass kept only what the step needs


@pytest.mark.parametrize("schedule,ranks,m", [("zbv", 2, 8), ("zbv", 4, 16), ("dualpipev", 2, 8),
                                              ("dualpipev", 4, 16), ("dualpipev", 2, 2)])
def test_v_schedules_fuse_the_splits_whose_w_follows_its_i_for_free(schedule, ranks, m):
    """zbv and DualPipeV keep their deferred W's; the few whose W lands right after its own I become one full B where
    the unit-cost step stays as short, as in interleaved-zb. The step is unchanged, the plan valid, the deferred
    W's all still there, and every adjacent pair left is needed."""
    from tracepp.codegen import schedules
    from tracepp.runtime.replay import replay

    stages = 2 * ranks
    s2r, top = placement(schedule, ranks, stages), Topology.chain(stages)
    unfused = schedules._orders(schedule, ranks, stages, m, s2r, top, training=True)
    plan = generate(schedule, ranks, stages, m)
    steps = replay(unfused, s2r, top).makespan
    assert replay(plan, s2r, top).makespan == steps
    validate(lower(plan, s2r, top), s2r, top, m)
    splits = lambda orders: sum(a.kind == "I" for actions in orders.values() for a in actions)  # noqa: E731
    fused = splits(unfused) - splits(plan)
    assert fused > 0  # each of these configurations has a W right after its I that buys nothing
    assert sum(a.kind == "B" for actions in plan.values() for a in actions) == (
        sum(a.kind == "B" for actions in unfused.values() for a in actions) + fused)
    _assert_every_split_left_is_needed(plan, s2r, top, steps)
