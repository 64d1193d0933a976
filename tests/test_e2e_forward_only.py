"""Tier 3: a forward-only model file (no loss_fn) runs under torchrun and writes the outputs eager forward gives."""
import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.runtime.launch import join_microbatches
from util import model_path, run_ok, torchrun

STEPS = 2


def test_join_microbatches_keeps_structure():
    outputs = [{"a": torch.ones(2, 3), "n": 4, "s": torch.tensor(1.0)},
               {"a": torch.zeros(1, 3), "n": 4, "s": torch.tensor(2.0)}]
    joined = join_microbatches(outputs)
    assert joined["a"].shape == (3, 3) and joined["n"] == 4
    assert [float(v) for v in joined["s"]] == [1.0, 2.0]


@pytest.mark.timeout(200)
def test_forward_only_outputs_equal_eager(tmp_path):
    path = model_path("forward_only")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=3, layout=Layout(pp=2))
    assert not manifest["training"]
    saved = str(tmp_path / "outputs.pt")
    result = run_ok(out, 2, "--steps", str(STEPS), "--save-outputs", saved)
    assert f"step {STEPS}/{STEPS}" in result.stdout
    outputs = torch.load(saved)
    module = load_model_file(path).module
    eager = module.model()
    assert len(outputs) == STEPS
    for step, output in enumerate(outputs):
        args, kwargs, _ = module.batch(step)
        with torch.no_grad():
            expected = eager(*args, **kwargs)
        assert set(output) == {"scores", "pooled"}
        for key in expected:
            torch.testing.assert_close(output[key], expected[key], rtol=0, atol=1e-6)
    # a training model file refuses the flag on every rank, before any step
    train_out = str(tmp_path / "train")
    split_model(model_path("tied_lm"), train_out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    refused = torchrun(train_out, 2, "--steps", "1", "--save-outputs", saved)
    assert refused.returncode != 0
    assert "--save-outputs" in refused.stderr and "forward-only" in refused.stderr
