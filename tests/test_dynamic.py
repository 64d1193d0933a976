"""Symbolic shapes: sequence length and batch size change every step, with no shape handshake."""
import json
import os

import pytest
import sympy
import torch

from tracepp.cli import main as cli_main
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.dynamic import parse_flags
from tracepp.runtime.shapes import compile_shape
from util import assert_state_close, assert_trained, eager_train, model_path, run_ok, torchrun


# ---- tier 1: plain data -------------------------------------------------------------------------------
def test_flags_parse():
    flags = parse_flags(["idx:1=seq[2:64]", "batch", "mask:1=seq"])
    assert flags.batch and flags.dims == [("idx", 1, "seq", 2, 64), ("mask", 1, "seq", None, None)]
    with pytest.raises(ValueError, match="INPUT:DIM=NAME"):
        parse_flags(["idx=seq"])


@pytest.mark.parametrize("expr", ["s_batch", "s_batch*s_seq", "(s_seq//2)", "1 + s_seq", "2*s_seq - 1",
                                  "s_batch*s_seq*16"])
def test_shape_code_matches_sympy(expr):
    symbols = {"s_batch": 3, "s_seq": 11}
    # the manifest's expressions are sympy expressions in Python syntax: both readings agree
    expected = int(sympy.sympify(expr).subs({sympy.Symbol(k): v for k, v in symbols.items()}))
    assert compile_shape([expr, 4])(symbols) == (expected, 4)
    assert eval(expr, {}, dict(symbols)) == expected


@pytest.fixture(scope="module")
def dynamic_out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dyn") / "out")
    split_model(model_path("dynamic_seq_lm"), out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    return out


def test_manifest_shapes_are_expressions_over_root_symbols(dynamic_out):
    manifest = json.load(open(os.path.join(dynamic_out, "manifest.json")))
    assert manifest["symbols"]["s_seq"] == {"min": 2, "max": 32, "source": "args[0] dim 1"}
    assert manifest["symbols"]["s_batch"]["min"] == 1 and manifest["batch_symbol"] == "s_batch"
    (value,) = manifest["values"].values()
    assert value["shape"] == ["s_batch", "s_seq", 16]
    # the size T = idx.shape[1] used by every layer is evaluated on the consuming stage, never sent
    sym_inputs = {item["name"]: item["expr"] for item in manifest["stages"][1]["sym_inputs"]}
    assert "s_seq" in sym_inputs.values()
    # expressions round-trip: parse with sympy, print back, same value at random points
    for dim in value["shape"]:
        if isinstance(dim, str):
            assert str(sympy.sympify(dim)) == dim
    rank1 = open(os.path.join(dynamic_out, "rank1.py")).read()
    assert "def boundary_shapes(*, s_batch, s_seq):" in rank1
    assert '"layers_1_out_from_stage0": (s_batch, s_seq, 16),' in rank1  # readable plain Python
    assert '"f32[s_batch, s_seq, 16]"' in rank1


def test_generated_shapes_match_manifest(dynamic_out):
    manifest = json.load(open(os.path.join(dynamic_out, "manifest.json")))
    scope = {}
    source = open(os.path.join(dynamic_out, "rank1.py")).read()
    start = source.index("def boundary_shapes")
    end = source.index("\n\n", source.index("    }", start))
    exec(source[start:end], scope)
    for batch, seq in [(1, 2), (3, 7), (10, 32)]:
        shapes = scope["boundary_shapes"](s_batch=batch, s_seq=seq)
        for name, value in manifest["values"].items():
            expected = tuple(int(sympy.sympify(str(d)).subs({"s_batch": batch, "s_seq": seq})) for d in value["shape"])
            assert shapes[f"{name}_from_stage{value['producer']}"] == expected


# ---- tier 3: torchrun ---------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_changing_seq_and_batch_match_eager(tmp_path, schedule):
    """Seq 12, 7, 16, 9 and batch 8, 8, 6, 10 (10 samples in 4 microbatches: 3, 3, 2, 2)."""
    path = model_path("dynamic_seq_lm")
    out = str(tmp_path / "out")
    split_model(path, out, schedule=schedule, num_microbatches=4, layout=Layout(pp=2))
    ckpt = str(tmp_path / "ckpt.pt")
    run_ok(out, 2, "--steps", "4", "--save", ckpt)
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 4))


def test_dynamic_flags_on_the_command_line(tmp_path, capsys):
    """A model file without dynamic_shapes, made dynamic from the CLI; 3 ranks; seq changes each step."""
    src = open(model_path("dynamic_seq_lm")).read().replace("dynamic_shapes = ", "_unused_dynamic_shapes = ")
    path = tmp_path / "flags_model.py"
    path.write_text(src)
    out = str(tmp_path / "out")
    code = cli_main(["split", str(path), "-o", out, "--ranks", "3", "--split-points", "layers.1,layers.3",
                     "--microbatches", "2", "--dynamic", "idx:1=seq[2:32]", "--dynamic", "batch"])
    assert code == 0, capsys.readouterr().err
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert set(manifest["symbols"]) == {"s_batch", "s_seq"}
    ckpt = str(tmp_path / "ckpt.pt")
    run_ok(out, 3, "--steps", "4", "--save", ckpt)
    assert_state_close(torch.load(ckpt), eager_train(str(path), 4))


@pytest.mark.parametrize("bad_step,message", [
    (1, "batch for step 1: args[0] dim 1 = 40 is outside the declared range [2, 16] of dynamic dim 's_seq'"),
    (2, "batch for step 2: input args[1] dim 1 is 5 but s_seq is 7 from another input"),
])
def test_bad_dynamic_batch_fails_on_every_rank(tmp_path, bad_step, message):
    path = model_path("dynamic_two_inputs")
    out = str(tmp_path / "out")
    code = cli_main(["split", path, "-o", out, "--ranks", "2", "--microbatches", "2",
                     "--dynamic", "x:1=seq[2:16]", "--dynamic", "weight:1=seq"])
    assert code == 0
    result = torchrun(out, 2, "--steps", "3", env_extra={"TRACEPP_TEST_BAD_STEP": str(bad_step)}, timeout=90)
    assert result.returncode != 0
    for rank in range(2):  # each rank names the bad batch: its own check, or (where another rank's came first, as on a
        #                    loaded machine) the failure it stops for
        said = (f"[tracepp rank {rank}] error: {message}", f"[tracepp rank {rank}] stopping because rank ")
        assert said[0] in result.stderr or (said[1] in result.stderr and f"failed: {message}" in result.stderr), \
            result.stderr[-3000:]


def test_one_sample_microbatches_with_dynamic_batch(tmp_path):
    """8 samples in 8 microbatches: export would pin a size-1 batch dim to 1, so tracepp traces 2 samples."""
    path = model_path("dynamic_seq_lm")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=8, layout=Layout(pp=2))
    assert manifest["batch_symbol"] == "s_batch"
    ckpt = str(tmp_path / "ckpt.pt")
    run_ok(out, 2, "--steps", "2", "--save", ckpt)
    assert_state_close(torch.load(ckpt), eager_train(path, 2))
