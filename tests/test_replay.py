"""Tier 1: the one replay engine, the one validator and the start-up check of edited rank scripts, as plain data."""
from __future__ import annotations

import pytest

from tracepp.codegen.emit import _actions_literal, _releases_literal
from tracepp.codegen.plan import build_plan
from tracepp.runtime.actions import Action, Topology
from tracepp.runtime.failure import PipelineError
from tracepp.runtime.replay import (UNIT_COSTS, ListPolicy, Replay, ScheduleError, check_plan, replay,
                                    validate)
from tracepp.runtime.script_check import check_programs, describe_program, program_digest

A = Action.parse
CHAIN2 = Topology.chain(2)


def acts(*texts):
    return [A(t) for t in texts]


def gpipe2():
    """gpipe, 2 ranks, 2 microbatches, lowered by hand."""
    return {
        0: acts("0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0RECV_B0<1", "0B0", "0RECV_B1<1", "0B1"),
        1: acts("1RECV_F0<0", "1F0", "1RECV_F1<0", "1F1", "1B0", "1SEND_B0>0", "1B1", "1SEND_B1>0"),
    }


# ------------------------------------------------------------------------------------------ the engine

def test_known_timeline_of_a_tiny_plan():
    result = replay(gpipe2(), [0, 1], CHAIN2)
    timeline = {r: [(pos, str(a), start, end) for pos, a, start, end in entries]
                for r, entries in result.timeline.items()}
    assert timeline == {
        0: [(0, "0F0", 0, 1), (2, "0F1", 1, 2), (5, "0B0", 5, 7), (7, "0B1", 7, 9)],
        1: [(1, "1F0", 1, 2), (3, "1F1", 2, 3), (4, "1B0", 3, 5), (6, "1B1", 5, 7)],
    }
    assert result.makespan == 9 and result.costs == UNIT_COSTS
    # rank 0's comm batches (a run of comm actions is one): the one holding gradient 0 completes when rank 1
    # sends it, at 5
    assert [([str(a) for a in b.ops], b.posted, b.done) for b in result.batches[0]] == [
        (["0SEND_F0>1"], 1, 1), (["0SEND_F1>1", "0RECV_B0<1"], 2, 5), (["0RECV_B1<1"], 7, 7)]
    # rank 0 learns that rank 1 posted both receives when gradient 0 (sent after them) arrives: after 0B0
    assert result.releases == {0: {5: [1, 3]}, 1: {}}
    assert result.first_release == {0: {1: 5, 3: 5}, 1: {}}
    # the static list is the trivial policy of the same engine
    again = Replay([0, 1], CHAIN2, {"F": 2.0}).run(ListPolicy(gpipe2()))
    assert again.makespan == 12 and again.orders == gpipe2()


def test_compute_only_lists_move_data_instantly():
    lists = {0: acts("0F0", "0F1", "0B0", "0B1"), 1: acts("1F0", "1B0", "1F1", "1B1")}
    result = replay(lists, [0, 1], CHAIN2)
    assert [(str(a), s, e) for _, a, s, e in result.timeline[1]] == [
        ("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7)]
    assert result.releases == {0: {}, 1: {}}


def test_deadlock_messages_name_rank_position_action_and_what_it_waits_for():
    lists = {0: acts("0F0", "0B0", "0F1", "0B1"), 1: acts("1F1", "1F0", "1B0", "1B1")}
    check_plan(lists, [0, 1], CHAIN2, 2)  # every rule holds; the order alone deadlocks
    with pytest.raises(ScheduleError) as caught:
        validate(lists, [0, 1], CHAIN2, 2)
    assert str(caught.value).startswith(
        "deadlock: rank 0 waits at action 1 '0B0' (for '1B0' or '1I0' on rank 1), rank 1 waits at action 0 '1F1' "
        "(for '0F1' on rank 0); reorder the compute actions")
    assert (caught.value.rank, caught.value.position, str(caught.value.action)) == (0, 1, "0B0")
    lowered = gpipe2()
    lowered[0] = acts("0F0", "0SEND_F0>1", "0F1", "0RECV_B0<1", "0B0", "0SEND_F1>1", "0RECV_B1<1", "0B1")
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at action 3 '0RECV_B0<1' \(rank 1 has not "
                                            r"reached '1SEND_B0>0'\), rank 1 waits at action 2 '1RECV_F1<0' .*"
                                            r"comm actions complete in list order"):
        validate(lowered, [0, 1], CHAIN2, 2)


def test_release_points_of_a_1f1b_plan():
    plan = build_plan("1f1b", 2, 2, 4, CHAIN2)
    named = {rank: {str(plan.actions[rank][at]): [str(plan.actions[rank][p]) for p in sends]
                    for at, sends in plan.releases[rank].items()} for rank in (0, 1)}
    # rank 0 may drop activations 0 and 1 once gradient 0 is back: rank 1 sent it after posting both receives
    assert named[0]["0B0"] == ["0SEND_F0>1", "0SEND_F1>1"]
    # rank 1's gradient for microbatch 0 is surely received once activation 2 arrives
    assert named[1]["1F2"] == ["1SEND_B0>0"]
    for rank in (0, 1):
        for at, sends in plan.releases[rank].items():
            assert not plan.actions[rank][at].is_comm and all(p < at for p in sends)
    assert plan.recv_placement in ("timed", "early") and plan.costs == UNIT_COSTS


# ------------------------------------------------------------------------------------------ the one validator

def _fails(lists, message, m=2, training=True):
    with pytest.raises(ScheduleError) as caught:
        validate(lists, [0, 1], CHAIN2, m, training)
    assert str(caught.value) == message
    return caught.value


def test_validator_messages_compute_only():
    lists = {0: acts("0F0", "0F1", "0B0", "0B1"), 1: acts("1F0", "1B0", "1F0", "1F1", "1B1")}
    _fails(lists, "rank 1, action 2 '1F0': duplicate F of stage 1 microbatch 0 (first at rank 1, action 0 '1F0'); "
                  "remove one of them")
    lists = {0: acts("0F0", "0F1", "0B0", "0B1"), 1: acts("1F0", "1W0", "1I0", "1F1", "1B1")}
    error = _fails(lists, "rank 1, action 1 '1W0': weight-grad W before the input-grad '1I0'; put '1I0' earlier on "
                          "rank 1")
    assert (error.rank, error.position, error.problem.split(";")[0]) == (1, 1, "weight-grad W before the input-grad "
                                                                              "'1I0'")
    lists = {0: acts("0F0", "0F1", "0B0", "0B1"), 1: acts("1B0", "1F0", "1F1", "1B1")}
    _fails(lists, "rank 1, action 0 '1B0': needs '1F0' (action 1) to run first; move it before action 0")
    lists = {0: acts("0F0", "0F1", "0B0"), 1: acts("1F0", "1B0", "1F1", "1B1")}
    _fails(lists, "stage 0 microbatch 1 has no backward: add '0B1' (or '0I1' and '0W1') to rank 0")
    lists = {0: acts("0F0", "0F1", "0B0", "0B1"), 1: acts("1F0", "1B0", "1F1", "1B1")}
    _fails(lists, "rank 0, action 2 '0B0': the model has no loss_fn (forward only), so the plan may hold only "
                  "forwards and their activations (F, SEND_F, RECV_F)", training=False)


def test_validator_messages_lowered():
    plan = gpipe2()
    plan[1].remove(A("1RECV_F0<0"))
    _fails(plan, "rank 1, action 0 '1F0': its input from stage 0 (RECV_F '1RECV_F0<0') has not arrived; add it "
                 "before action 0, and '0SEND_F0>1' on rank 0")
    plan = gpipe2()
    plan[1][0], plan[1][1] = plan[1][1], plan[1][0]
    _fails(plan, "rank 1, action 0 '1F0': its input from stage 0 (RECV_F '1RECV_F0<0') has not arrived; move it "
                 "(action 1) before action 0")
    plan = gpipe2()
    plan[0][0], plan[0][1] = plan[0][1], plan[0][0]
    _fails(plan, "rank 0, action 0 '0SEND_F0>1': sends activations before '0F0' has run; move it after '0F0'")
    plan = gpipe2()
    plan[0].remove(A("0SEND_F1>1"))
    _fails(plan, "rank 1, action 2 '1RECV_F1<0': no matching '0SEND_F1>1' on rank 0; add it there or remove this "
                 "receive")


# ------------------------------------------------------------------------------------------ edited rank scripts

def _programs(tmp_path, lists, releases, plan):
    """Each rank's program as the start-up exchange sees it, from scripts written the way emit writes them."""
    programs = []
    for rank, actions in sorted(lists.items()):
        path = tmp_path / f"rank{rank}.py"
        text = "# header\n\n" + _actions_literal(actions) + "\n\n"
        if releases.get(rank) is not None:
            text += _releases_literal(actions, releases[rank]) + "\n"
        path.write_text(text)
        programs.append(describe_program(rank, str(path), actions, releases.get(rank)))
    return programs


def _manifest(plan):
    lists = {str(r): [str(a) for a in acts] for r, acts in plan.actions.items()}
    return {"stages": [{}, {}], "values": {"x": {"producer": 0, "consumers": [1], "requires_grad": True}},
            "training": True,
            "plan": {"stage_to_rank": plan.stage_to_rank, "num_microbatches": plan.num_microbatches,
                     "actions": lists, "digests": {r: program_digest(lists[r], plan.releases[int(r)]) for r in lists}}}


def test_unedited_scripts_run_without_a_second_validation(tmp_path):
    plan = build_plan("1f1b", 2, 2, 4, CHAIN2)
    assert check_programs(_programs(tmp_path, plan.actions, plan.releases, plan), _manifest(plan)) is None


def test_valid_edits_run_as_edited(tmp_path):
    plan = build_plan("1f1b", 2, 2, 4, CHAIN2)
    lists = {r: list(a) for r, a in plan.actions.items()}
    first = lists[0].index(A("0SEND_F0>1"))
    lists[0][first], lists[0][first + 1] = lists[0][first + 1], lists[0][first]  # 0F1 before sending 0's activation
    note = check_programs(_programs(tmp_path, lists, {0: None, 1: plan.releases[1]}, plan), _manifest(plan))
    assert note == "rank0.py differs from the plan tracepp wrote; the gathered plan was validated and runs as edited"


def test_broken_edit_is_refused_with_file_and_line(tmp_path):
    plan = build_plan("1f1b", 2, 2, 4, CHAIN2)
    lists = {r: list(a) for r, a in plan.actions.items()}
    lists[1].remove(A("1RECV_F2<0"))  # drop a receive
    programs = _programs(tmp_path, lists, {0: plan.releases[0], 1: None}, plan)
    with pytest.raises(PipelineError) as caught:
        check_programs(programs, _manifest(plan))
    position = lists[1].index(A("1F2"))
    line = (tmp_path / "rank1.py").read_text().splitlines().index(
        next(text for text in (tmp_path / "rank1.py").read_text().splitlines() if '"1F2"' in text)) + 1
    assert str(caught.value).startswith(
        f"rank1.py line {line}: action '1F2' (ACTIONS[{position}]): its input from stage 0 (RECV_F '1RECV_F2<0') has "
        f"not arrived; add it before action {position}, and '0SEND_F2>1' on rank 0 [the plan in the rank scripts "
        f"(rank1.py edited) breaks this rule, so no rank starts")
    assert caught.value.every_rank_agrees


def test_stale_releases_are_refused(tmp_path):
    """The same valid reordering, but rank 0 keeps its RELEASES: position 1 is no longer a send."""
    plan = build_plan("1f1b", 2, 2, 4, CHAIN2)
    lists = {r: list(a) for r, a in plan.actions.items()}
    lists[0][1], lists[0][2] = lists[0][2], lists[0][1]
    programs = _programs(tmp_path, lists, plan.releases, plan)
    at = min(plan.releases[0])
    with pytest.raises(PipelineError, match=rf"rank0.py line \d+: RELEASES\[{at}\]: position 1 is not a send before "
                                            rf"action {at}"):
        check_programs(programs, _manifest(plan))
    # a release moved earlier than the engine can prove safe: refused, naming the hang it risks
    early = {0: {2: [1]}, 1: plan.releases[1]}  # wait on 0SEND_F0>1 after 0F1: rank 1 may not have posted yet
    with pytest.raises(PipelineError, match=r"rank0.py line \d+: RELEASES\[2\]: waits on '0SEND_F0>1' \(ACTIONS\[1\]\) "
                                            r"after action 2 '0F1', but rank 1 has provably posted its receive only "
                                            r"after action 5 '0B0': the wait could hang"):
        check_programs(_programs(tmp_path, plan.actions, early, plan), _manifest(plan))


def test_manifest_of_an_older_format_is_refused():
    from tracepp.runtime.loading import MANIFEST_FORMAT, check_format

    check_format({"format": MANIFEST_FORMAT}, "out/manifest.json")
    with pytest.raises(PipelineError, match=r"out/manifest.json has manifest format 1, but this tracepp reads format "
                                            rf"{MANIFEST_FORMAT}: re-run `tracepp split`"):
        check_format({"format": 1}, "out/manifest.json")
