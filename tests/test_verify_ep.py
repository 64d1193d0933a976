"""Every expert-parallel plan is verified at split time (``split/verify_ep.py``): each stage's rewritten program runs
for every rank of one expert-parallel group in this one process (each rank its own microbatch, the all-to-alls
answered across the group, dispatch and combine the runtime's own ops with their registered backward), against
the stage graphs before the rewrite, forward and backward.

Correct plans verify (the moe models of tests/test_e2e_ep.py: Mixtral, Qwen3-MoE, DeepSeek-V3, transformers'
sentinel mask, torchtitan's grouped matmuls, expert weights stored on any dim; at ep 4; with tp and with cp); wrong
ones are refused naming the op and the model's line, under ``--verify on`` and ``strict`` alike: a rank loading its
neighbour's experts, a combine that drops its permutation, tokens counted to the wrong expert, rows regrouped by
source instead of expert, grouped matmuls left on the token rank's offsets, a combine whose backward alone is wrong.
``--verify off`` records nothing.
"""
import os
import sys

import pytest
import torch

from tracepp.driver import check_model
from tracepp.runtime import expert_parallel as ep_runtime
from tracepp.runtime.mesh import Layout
from tracepp.split import expert_parallel, verify_ep
from util import REPO, model_path

pytestmark = pytest.mark.timeout(600)

ZOO = os.path.join(REPO, "tests", "zoo")
TITAN = model_path("torchtitan_moe")


def _check(path, mode="on", pp=2, microbatches=2, **layout):
    extra = {"split_points": "auto", "num_stages": 1} if pp == 1 else {}
    return check_model(path, num_microbatches=microbatches, layout=Layout(pp=pp, **layout), verify=mode, **extra)


def _verified(manifest, stages=("stage 0", "stage 1")):
    record = manifest["ep"]["verified"]
    assert record["status"] == "verified", record
    assert record["ran"] == list(stages), record
    return record


def test_a_correct_ep_plan_verifies_and_inspect_prints_it():
    from tracepp.report.stages import expert_parallel_table

    manifest = _check(os.path.join(ZOO, "mixtral.py"), dp=2, ep=2)
    record = _verified(manifest)
    assert record["ranks"] == "2 ep ranks (dp replicas 0 - 1, each its own microbatch)"
    assert "verification: verified: every stage's 2 ep ranks (dp replicas 0 - 1, each its own microbatch) computed " \
           "what the unsharded stage does" in expert_parallel_table(manifest)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_hugging_face_moe_families_verify(name):
    _verified(_check(os.path.join(ZOO, name + ".py"), dp=2, ep=2))


def test_a_complex_rotary_table_is_verified_in_complex128(monkeypatch):
    """DeepSeek-V2's rotary table is complex (``torch.polar``, a ``complex64`` dtype asserted in the graph): the
    interpreter reads complex dtypes at double precision as it reads floating ones, and compares complex values as
    their (real, imaginary) pairs. It was 'not verified: Tensor dtype mismatch'."""
    monkeypatch.setenv("HF_FAMILY", "deepseek_v2")
    _verified(_check(os.path.join(ZOO, "hf_family.py"), dp=2, ep=2))


@pytest.mark.parametrize("name", ["torchtitan_moe", "moe_sentinel"])
def test_the_other_moe_spellings_verify(name):
    _verified(_check(model_path(name), dp=2, ep=2))


def test_experts_stored_on_any_dim_verify(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(TITAN))
    _verified(_check(model_path("moe_expert_dims"), pp=1, dp=2, ep=2), stages=("stage 0",))


def test_a_per_row_norm_between_the_expert_matmuls_is_placed_and_verified(monkeypatch):
    # the rows are placed through the block by the shared rules (ep_walk): a mean over the features carries them;
    # the list of per-row ops before refused it ("mean_dim ... is not a per-row op")
    monkeypatch.syspath_prepend(os.path.dirname(TITAN))
    manifest = _check(model_path("moe_row_norm"), dp=2, ep=2)
    assert manifest["ep"]["blocks"] and not any(b.get("refused") for b in manifest["ep"]["blocks"])
    _verified(manifest)


def test_four_ep_ranks_verify():
    # 4 replicas of one sample each, 1 expert of Mixtral's 4 per rank
    record = _verified(_check(os.path.join(ZOO, "mixtral.py"), microbatches=1, dp=4, ep=4))
    assert record["ranks"].startswith("4 ep ranks")


def test_ep_with_tp_runs_every_tp_rank_of_every_ep_rank(monkeypatch):
    monkeypatch.setenv("TP_HF_FAMILY", "mixtral")
    manifest = _check(os.path.join(ZOO, "tp_hf.py"), dp=2, ep=2, tp=2)
    record = _verified(manifest)
    assert record["ranks"].endswith("x 2 tp ranks") and "tp.verified" in record["scope"], record
    assert manifest["tp"]["verified"]["status"] == "verified"


def test_ep_over_the_cp_ranks_of_a_replica(monkeypatch):
    monkeypatch.setenv("CP_HF_FAMILY", "mixtral")
    manifest = _check(os.path.join(ZOO, "cp_hf.py"), cp=2, ep=2)
    assert _verified(manifest)["ranks"] == "the 2 cp ranks of replica 0 (1 ep group of 2)"
    assert manifest["cp"]["verified"]["status"] == "verified"


def test_verify_off_records_nothing():
    assert "verified" not in _check(TITAN, mode="off", dp=2, ep=2)["ep"]


# ---- wrong plans, each refused naming the op

def _refused(match, mode="on"):
    with pytest.raises(ValueError, match=r"--ep 2: the plan does not compute what the model does: stage 0: " + match):
        _check(TITAN, mode=mode, dp=2, ep=2)


@pytest.mark.parametrize("mode", ["on", "strict"])
def test_a_rank_holding_its_neighbours_experts_is_refused(monkeypatch, mode):
    original = ep_runtime.piece_for

    def piece_for(manifest, size, rank):  # experts [r E/ep + 1, (r + 1) E/ep + 1): off by one
        return original(manifest, size, (rank + 1) % size)

    monkeypatch.setattr(ep_runtime, "piece_for", piece_for)
    _refused(r"the value of to_1 on ep rank 0 \(its experts 0 - 1\) .*\(aten.to.dtype at torchtitan_moe.py:33\)",
             mode)


def test_a_combine_without_its_permutation_is_refused(monkeypatch):
    def combine_rows(rows, plan):  # the rows sent back in the order they arrived (source-major), not regrouped
        sent, received = plan[0], plan[1]
        return ep_runtime._exchange(rows, received.sum(1).tolist(), sent.sum(1).tolist())

    monkeypatch.setattr(ep_runtime, "_combine_rows", combine_rows)
    _refused(r"the value of ep_combine_default \(_grouped_mm_2's rows back on their tokens' rank\) .*"
             r"\(tracepp.ep_combine.default at torchtitan_moe.py:\d+\)")


def test_tokens_counted_to_the_wrong_expert_are_refused(monkeypatch):
    original = ep_runtime._counts

    def counts(offsets):  # one of the last expert's rows counted as the first expert's
        out = original(offsets).clone()
        if out[-1] > 0:
            out[-1] -= 1
            out[0] += 1
        return out

    monkeypatch.setattr(ep_runtime, "_counts", counts)
    _refused(r"the rows ep_dispatch_default gives ep rank 0 \(its experts' rows from every ep rank, by expert\) .*"
             r"\(tracepp.ep_dispatch.default at torchtitan_moe.py:33\)")


def test_rows_left_by_source_instead_of_by_expert_are_refused(monkeypatch):
    monkeypatch.setattr(ep_runtime, "_order", lambda received: torch.arange(int(received.sum())))
    _refused(r"the rows ep_dispatch_default gives ep rank 0 .*\(tracepp.ep_dispatch.default at torchtitan_moe.py:33\)"
             r" differs from the unsharded graph by")


def test_expert_matmuls_left_on_the_token_ranks_offsets_are_refused(monkeypatch):
    monkeypatch.setattr(expert_parallel, "_set_offsets", lambda matmul, new: None)  # the rewrite forgets them
    _refused(r"the value of _grouped_mm \(aten._grouped_mm.default at torchtitan_moe.py:33\) fails on the ranks' "
             r"values \(IndexError")


def test_a_combine_whose_backward_alone_is_wrong_is_named(monkeypatch):
    original = ep_runtime._dispatch_rows

    def dispatch_rows(rows, plan):  # combine's backward (ep_combine's registered autograd) halves the gradient
        out = original(rows, plan)
        return out / 2 if sys._getframe(1).f_code.co_name == "combine_backward" else out

    monkeypatch.setattr(ep_runtime, "_dispatch_rows", dispatch_rows)
    _refused(r"the gradient of _grouped_mm_2 on ep rank 0 \(ep_combine_default's backward\) .*"
             r"\(tracepp.ep_combine.default at torchtitan_moe.py:\d+\)")


# ---- the all-to-all across a group

def test_an_all_to_all_whose_splits_disagree_fails_as_a_real_one_would():
    def rank(k):  # each sends one row to each; rank 0 expects two from rank 1
        out = torch.empty(3 if k == 0 else 1, 1)
        torch.distributed.all_to_all_single(out, torch.full((2, 1), float(k)), [1, 2] if k == 0 else [1, 0],
                                            [1, 1])
        return out

    with verify_ep._RuntimeState():
        with pytest.raises(RuntimeError, match="ep rank 1 sends 1 rows to ep rank 0, which expects 2"):
            verify_ep._spmd([lambda: rank(0), lambda: rank(1)])
        ok = verify_ep._spmd([lambda k=k: _exchange_two(k) for k in range(2)])
    assert [o.flatten().tolist() for o in ok] == [[0.0, 1.0], [0.0, 1.0]]
    assert ep_runtime._STATE.get("size", 1) == 1  # the runtime's state as it was


def _exchange_two(k):
    out = torch.empty(2, 1)
    torch.distributed.all_to_all_single(out, torch.full((2, 1), float(k)))
    return out
