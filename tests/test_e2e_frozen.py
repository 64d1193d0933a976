"""Tier 3: frozen parameters and a stateful optimizer (AdamW) with a weight tied across ranks, against eager."""
import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import assert_state_close, assert_trained, eager_train, initial_state, model_path, run_ok

STEPS = 3
FROZEN = ("layers.0.norm.weight", "layers.0.norm.bias", "layers.0.fc.weight", "layers.0.fc.bias",
          "norm.weight", "norm.bias")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("schedule,stages", [("1f1b", None), ("interleaved-zb", 4)])
def test_frozen_parameters_and_adamw_with_a_tied_weight_match_eager(tmp_path, schedule, stages):
    path = model_path("frozen_tied_lm")
    out = str(tmp_path / "out")
    split_model(path, out, num_stages=stages, schedule=schedule, num_microbatches=4, layout=Layout(pp=2))
    ckpt = str(tmp_path / "ckpt.pt")
    run_ok(out, 2, "--steps", str(STEPS), "--save", ckpt)
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, STEPS))
    initial = initial_state(path)
    for name in FROZEN:  # unchanged bit for bit: no gradient, no weight decay, no optimizer state
        assert torch.equal(saved[name], initial[name]), name
    assert torch.equal(saved["embed.weight"], saved["head.weight"])  # the tied copies stayed one weight
