"""Tier 1: the training pieces of the runtime without processes: optimizer/scheduler building, LR schedule
values, which stages activation checkpointing picks, and checkpoint save/resume in one process."""
import math
import types

import pytest
import torch
import torch.nn as nn

from tracepp.runtime import checkpoint
from tracepp.runtime.optim import (OptimizerConfigError, build_optimizer, build_scheduler, parameter_fqns,
                                   step_scheduler, warmup_cosine)
from tracepp.runtime.recompute import max_in_flight, stage_modes, stages_to_checkpoint


def _named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    return model, list(model.named_parameters())


def test_optimizer_hook_gets_tensors_or_named_pairs():
    _model, named = _named()
    seen = {}

    def plain(params):
        seen["plain"] = params
        return torch.optim.SGD(params, lr=0.1)

    def by_name(named_params):
        seen["named"] = [name for name, _p in named_params]
        return torch.optim.AdamW([p for _n, p in named_params], lr=0.1)

    build_optimizer(types.SimpleNamespace(optimizer=plain), named)
    assert all(isinstance(p, torch.Tensor) for p in seen["plain"]) and len(seen["plain"]) == 4
    optimizer = build_optimizer(types.SimpleNamespace(optimizer=by_name), named)
    assert seen["named"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert parameter_fqns(optimizer, named) == seen["named"]
    with pytest.raises(OptimizerConfigError, match="returned list, not a torch.optim.Optimizer"):
        build_optimizer(types.SimpleNamespace(optimizer=lambda params: params), named)


def test_flag_optimizer_decays_matrices_only():
    _model, named = _named()
    optimizer = build_optimizer(types.SimpleNamespace(), named, name="adamw", lr=0.5, weight_decay=0.1)
    assert isinstance(optimizer, torch.optim.AdamW)
    decays = {name: group["weight_decay"] for group in optimizer.param_groups
              for name, p in named if any(p is q for q in group["params"])}
    assert decays == {"0.weight": 0.1, "0.bias": 0.0, "1.weight": 0.0, "1.bias": 0.0}
    with pytest.raises(OptimizerConfigError, match="--optimizer 'lion' is not one of sgd, adamw"):
        build_optimizer(types.SimpleNamespace(), named, name="lion")


def test_warmup_then_cosine_to_zero():
    factor = warmup_cosine(2, 6)
    assert [factor(s) for s in range(2)] == [0.5, 1.0]
    assert factor(2) == 1.0 and factor(6) == pytest.approx(0.0, abs=1e-12)
    assert factor(4) == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 4)))
    _model, named = _named()
    optimizer = build_optimizer(types.SimpleNamespace(), named, lr=0.4)
    scheduler = build_scheduler(types.SimpleNamespace(), optimizer, warmup=2, total_steps=6)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert build_scheduler(types.SimpleNamespace(), optimizer, warmup=0, total_steps=6) is None
    del scheduler


def test_scheduler_that_raises_is_named():
    _model, named = _named()
    optimizer = build_optimizer(types.SimpleNamespace(), named)

    def broken(optimizer):
        raise KeyError("initial_lr")

    with pytest.raises(OptimizerConfigError, match="lr_scheduler\\(optimizer\\) raised KeyError"):
        build_scheduler(types.SimpleNamespace(lr_scheduler=broken), optimizer)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (3 - step))
    step_scheduler(scheduler, 0)
    step_scheduler(scheduler, 1)
    with pytest.raises(OptimizerConfigError, match="LambdaLR raised ZeroDivisionError at step 3"):
        step_scheduler(scheduler, 2)


def test_checkpointing_modes_choose_stages_and_their_kind():
    first = ["0F0", "0F1", "0SEND_F1>1", "0B0", "0F2", "0B1", "0B2"]
    last = ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]
    assert max_in_flight(first, 0) == 2 and max_in_flight(last, 1) == 1
    # in-flight: whole recomputation where a stage holds several microbatches at once, none where it holds one
    assert stages_to_checkpoint("in-flight", [0], first) == {0: "full"}
    assert stages_to_checkpoint("in-flight", [1], last) == {}
    assert stages_to_checkpoint("full", [1], last) == {1: "full"}
    assert stages_to_checkpoint("selective", [1], last) == {1: "selective"}
    assert stages_to_checkpoint("none", [0], first) == {}
    # one mode per stage of the pipeline (what the tuner chooses)
    assert stages_to_checkpoint("selective,none", [0], first, 2) == {0: "selective"}
    assert stages_to_checkpoint("selective,full", [1], last, 2) == {1: "full"}
    assert stage_modes("in-flight", 2, lambda s: first if s == 0 else last) == ["full", "none"]
    with pytest.raises(ValueError, match="'some' is not one of none, full, selective, in-flight"):
        stages_to_checkpoint("some", [0], first)
    with pytest.raises(ValueError, match="lists 3 stage modes; the pipeline has 2 stages"):
        stages_to_checkpoint("full,none,none", [0], first, 2)


def test_latest_checkpoint_skips_incomplete_and_refuses_empty(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.latest_checkpoint(str(tmp_path))
    for name in ("step_2", "step_10"):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint.MARKER).write_text("")
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_14.tmp").mkdir()
    step, path, skipped = checkpoint.latest_checkpoint(str(tmp_path))
    assert step == 10 and path.endswith("step_10")
    assert sorted(p.rsplit("/", 1)[1] for p in skipped) == ["step_12", "step_14.tmp"]


def _train(model, optimizer, steps, start=0):
    for step in range(start, steps):
        torch.manual_seed(step)
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_resume_by_fqn_into_another_parameter_order(tmp_path):
    """Saved with one parameter order and grouping, loaded into another (as another split would): 2 + 2 steps
    of AdamW equal 4."""
    model, named = _named()
    optimizer = torch.optim.AdamW([p for _n, p in named], lr=0.05, weight_decay=0.1)
    _train(model, optimizer, 2)
    info = {"model_sha256": "x", "fqns": [n for n, _p in named], "optimizer": "AdamW", "world_size": 1}
    path = checkpoint.save(str(tmp_path), 2, dict(model.state_dict()), optimizer,
                           parameter_fqns(optimizer, named), info, rank=0)
    _train(model, optimizer, 4, start=2)

    fresh, fresh_named = _named()
    reordered = list(reversed(fresh_named))
    groups = [{"params": [p for _n, p in reordered[:2]]}, {"params": [p for _n, p in reordered[2:]]}]
    fresh_optimizer = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    fqns = parameter_fqns(fresh_optimizer, fresh_named)
    checkpoint.check_compatible(path, checkpoint.read_info(path), info)
    prepared = checkpoint.prepare_load(path, dict(fresh.state_dict()), fresh_optimizer, fqns, 0, True)
    checkpoint.load(prepared, fresh_optimizer, fqns)
    _train(fresh, fresh_optimizer, 4, start=2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_resume_refuses_mismatched_optimizer_state_and_model(tmp_path):
    model, named = _named()
    optimizer = torch.optim.AdamW([p for _n, p in named], lr=0.05)
    _train(model, optimizer, 1)
    info = {"model_sha256": "aaaa", "fqns": [n for n, _p in named], "optimizer": "AdamW", "world_size": 1}
    path = checkpoint.save(str(tmp_path), 1, dict(model.state_dict()), optimizer,
                           parameter_fqns(optimizer, named), info, rank=0)
    wider = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5))
    wider_named = list(wider.named_parameters())
    wider_optimizer = torch.optim.AdamW([p for _n, p in wider_named], lr=0.05)
    with pytest.raises(checkpoint.CheckpointError, match=r"0.weight is shape \[3, 4\], this model has shape \[5, 4\]"):
        checkpoint.prepare_load(path, dict(wider.state_dict()), wider_optimizer,
                                parameter_fqns(wider_optimizer, wider_named), 0, True)
    other = dict(info, model_sha256="bbbb", fqns=["encoder.weight"])
    with pytest.raises(checkpoint.CheckpointError, match="is from another model .*missing from it: \\['encoder.weight'\\]"):
        checkpoint.check_compatible(path, checkpoint.read_info(path), other)
    # the saved optimizer covered only the Linear (a frozen LayerNorm then); now it covers every parameter
    partial_dir = tmp_path / "partial"
    partial = torch.optim.AdamW([p for _n, p in named[:2]], lr=0.05)
    _train(model, partial, 1)
    path = checkpoint.save(str(partial_dir), 1, dict(model.state_dict()), partial,
                           parameter_fqns(partial, named), info, rank=0)
    full = torch.optim.AdamW([p for _n, p in named], lr=0.05)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"no optimizer state for \['1.weight', '1.bias'\] while other parameters have some"):
        checkpoint.prepare_load(path, dict(model.state_dict()), full, parameter_fqns(full, named), 0, True)
