"""Tier 3 for the multi-stage schedules: every one trains through ``split_model`` + torchrun (gloo) on 2 ranks
holding 2 stages each, and the trained parameters equal eager training within 2e-5.

Covers loop placement (interleaved-1f1b, looped-bfs, interleaved-zb), V placement (zbv, dualpipev: stage 0
and the last stage share rank 0), split backward (I then W on the retained graph), values handed between
stages of one rank in memory, a skip connection into both legs of a V, a tied embedding whose two stages sit on one rank (one tensor for both), a
microbatch count that is not a multiple of the ranks, and a user CSV plan through ``tracepp split``.
Single-stage schedules (gpipe, 1f1b) are covered by test_e2e_train.py.
"""
import json
import os

import pytest
import torch

from tracepp.cli import main as cli_main
from tracepp.runtime.actions import Action, Topology
from tracepp.codegen.csvio import dump_csv
from tracepp.codegen.plan import build_plan
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from util import assert_state_close, assert_trained, eager_train, model_path, run_ok

STEPS = 3
RANKS = 2
FOUR_STAGES = ["layers.1", "layers.2", "layers.3"]
PLACEMENT = {"loop": [0, 1, 0, 1], "v": [0, 1, 1, 0]}


def _train_and_compare(out: str, path: str, tmp_path) -> dict:
    ckpt = str(tmp_path / "ckpt.pt")
    result = run_ok(out, RANKS, "--steps", str(STEPS), "--save", ckpt)
    assert f"step {STEPS}/{STEPS}" in result.stdout
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, STEPS))
    load_model_file(path).model().load_state_dict(saved)  # the checkpoint loads strictly
    return saved


def _check_plan(manifest: dict, schedule: str, microbatches: int, style: str) -> None:
    plan = manifest["plan"]
    assert (plan["schedule"], plan["placement"], plan["num_microbatches"]) == (schedule, style, microbatches)
    assert plan["stage_to_rank"] == PLACEMENT[style]
    kinds = {Action.parse(a).kind for acts in plan["actions"].values() for a in acts}
    split_backward = schedule in ("interleaved-zb", "zbv", "dualpipev")
    assert ({"I", "W"} <= kinds) == split_backward, f"{schedule}: action kinds {sorted(kinds)}"


@pytest.mark.parametrize("schedule,microbatches", [
    ("interleaved-1f1b", 4),
    ("looped-bfs", 4),
    ("interleaved-zb", 4),
    ("zbv", 4),
    ("dualpipev", 4),  # m = 2p: DualPipeV's own phases
    ("dualpipev", 2),  # m < 2p: the greedy V fallback
])
def test_multi_stage_schedule_matches_eager(tmp_path, schedule, microbatches):
    path = model_path("residual_mlp_lm")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule=schedule, num_microbatches=microbatches,
                           split_points=FOUR_STAGES, layout=Layout(pp=RANKS))
    _check_plan(manifest, schedule, microbatches, "v" if schedule in ("zbv", "dualpipev") else "loop")
    for rank in range(RANKS):  # each rank script holds its two stage functions
        source = open(os.path.join(out, f"rank{rank}.py")).read()
        stages = [s for s, r in enumerate(manifest["plan"]["stage_to_rank"]) if r == rank]
        assert all(f"def stage{s}_forward(" in source for s in stages), (rank, stages)
    _train_and_compare(out, path, tmp_path)


def _rank0_pipeline(out: str):
    """The public view of rank 0 (its stages as modules, weights loaded), without a process group."""
    from tracepp.runtime import Pipeline

    return Pipeline(out, rank=0, device="cpu")


@pytest.mark.parametrize("schedule,microbatches", [("zbv", 4), ("dualpipev", 6)])
def test_tied_embedding_on_one_rank_of_a_v(tmp_path, schedule, microbatches):
    """V placement puts stage 0 (embedding) and stage 3 (LM head) on rank 0: both must use ONE parameter, so
    that its gradient sums both uses without any all-reduce; eager equality proves the sum is right."""
    path = model_path("tied_lm_v")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule=schedule, num_microbatches=microbatches, layout=Layout(pp=RANKS))
    _check_plan(manifest, schedule, microbatches, "v")
    [shared] = manifest["shared"]
    assert sorted(shared["aliases"]) == ["embed.weight", "head.weight"] and shared["stages"] == [0, 3]
    pipe = _rank0_pipeline(out)
    assert sorted(pipe.stages) == [0, 3]
    tied = [p for p in pipe.stages[0].parameters() if any(p is q for q in pipe.stages[3].parameters())]
    assert [name for name, p in pipe.named_parameters() if p is tied[0]] == [shared["fqn"]]
    assert len(tied) == 1 and tuple(tied[0].shape) == (24, 12), "stages 0 and 3 must share one tensor"
    assert "use one tensor on this rank" in open(os.path.join(out, "rank0.py")).read()
    saved = _train_and_compare(out, path, tmp_path)
    assert torch.equal(saved["embed.weight"], saved["head.weight"])


@pytest.mark.parametrize("schedule,style", [("zbv", "v"), ("interleaved-zb", "loop")])
def test_skip_connection_split_backward(tmp_path, schedule, style):
    """Stage 0's h0 feeds stages 1 and 3. V: stage 3 shares rank 0 with stage 0 (h0 handed over in memory, its
    gradient summed from a received one and an in-memory one); loop: both consumers sit on rank 1."""
    path = model_path("skip_v")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule=schedule, num_microbatches=4, layout=Layout(pp=RANKS))
    _check_plan(manifest, schedule, 4, style)
    [skip] = [v for v in manifest["values"].values() if len(v["consumers"]) > 1]
    assert (skip["producer"], skip["consumers"]) == (0, [1, 3])
    _train_and_compare(out, path, tmp_path)


def test_interleaved_microbatches_not_a_multiple_of_ranks(tmp_path):
    """3 microbatches on 2 ranks: one group of 3 (Megatron's rule would need a multiple of 2)."""
    path = model_path("tied_lm_v")  # batch 12: 3 microbatches of 4
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule="interleaved-1f1b", num_microbatches=3, layout=Layout(pp=RANKS))
    _check_plan(manifest, "interleaved-1f1b", 3, "loop")
    # the tied weight now lives on both ranks (stage 0 on rank 0, stage 3 on rank 1): all-reduced
    assert manifest["shared"][0]["stages"] == [0, 3]
    _train_and_compare(out, path, tmp_path)


def test_user_csv_plan_through_the_cli(tmp_path, capsys):
    """A compute-only CSV (here: zbv's order, V placement inferred from the rows) via `tracepp split`."""
    path = model_path("residual_mlp_lm")
    plan = build_plan("zbv", RANKS, 4, 4, Topology.chain(4))
    csv_path = str(tmp_path / "my_plan.csv")
    dump_csv({r: [a for a in acts if not a.is_comm] for r, acts in plan.actions.items()}, csv_path)
    assert "SEND" not in open(csv_path).read()
    out = str(tmp_path / "out")
    code = cli_main(["split", path, "-o", out, "--ranks", str(RANKS), "--schedule", csv_path,
                     "--microbatches", "4", "--split-points", ",".join(FOUR_STAGES)])
    assert code == 0, capsys.readouterr().err
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["plan"]["placement"] == "csv"
    assert manifest["plan"]["stage_to_rank"] == PLACEMENT["v"]
    assert manifest["plan"]["actions"] == {str(r): [str(a) for a in acts] for r, acts in plan.actions.items()}
    _train_and_compare(out, path, tmp_path)
