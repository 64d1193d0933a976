"""Memory you can plan on (issue 46), tier 3: each rank's peak predicted at split time (counted on fake tensors,
walked over the plan's timeline) against the peak the run measures (``run.py --measure-memory``: every live tensor
storage counted on CPU), within 10%; and what each forward keeps for backward, per microbatch, against what the
run's forwards left.

The matrix covers dense Llama, GPT-2, Mixtral and a small DeepSeek-V3 (``tests/models/memory_zoo.py``); fp32 and
bf16; activation checkpointing none, full and selective; GPipe, 1F1B, interleaved 1F1B and zero-bubble; FSDP over
``--dp 2``, ``--tp 2 --sequence-parallel`` and ``--ep 2``; SGD and AdamW. Each case is one small run of two steps
(the peak of a step after the first, when the optimizer's state exists, is the one that counts).
"""
import json
import os

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.actions import Action
from tracepp.runtime.mesh import Layout
from tracepp.runtime.run_options import RunOptions
from util import assert_state_close, assert_trained, model_path, torchrun

pytestmark = pytest.mark.timeout(600)
TOLERANCE = 0.10

# (id, family, world, split options, layout, run options)
CASES = [
    ("llama-gpipe-bf16-full-adamw", "llama", 2, dict(schedule="gpipe", num_microbatches=4), Layout(pp=2),
     RunOptions(precision="bf16", activation_checkpointing="full", optimizer="adamw")),
    ("gpt2-interleaved-zero-bubble-fp32-selective", "gpt2", 2,
     dict(schedule="interleaved-zb", num_stages=4, num_microbatches=4), Layout(pp=2),
     RunOptions(activation_checkpointing="selective")),
    ("deepseek_v3-1f1b-fp32-none", "deepseek_v3", 2, dict(schedule="1f1b", num_microbatches=4), Layout(pp=2),
     RunOptions()),
    ("llama-fsdp-dp2-interleaved-1f1b-fp32", "llama", 4,
     dict(schedule="interleaved-1f1b", num_stages=4, num_microbatches=2), Layout(pp=2, dp=2),
     RunOptions(optimizer="adamw")),
    ("llama-tp2-sequence-parallel-1f1b-bf16-selective", "llama", 4, dict(schedule="1f1b", num_microbatches=2),
     Layout(pp=2, tp=2, sequence_parallel=True), RunOptions(precision="bf16", activation_checkpointing="selective")),
    ("mixtral-dp2-ep2-1f1b-fp32", "mixtral", 4, dict(schedule="1f1b", num_microbatches=2), Layout(pp=2, dp=2, ep=2),
     RunOptions()),
]


def _forward_kept(measured: dict, manifest: dict) -> list:
    """(stage, measured, predicted): the mean of what each forward of a stage left alive in the run's last step
    (FSDP's and DDP's first forward of a step also gathers the stage's parameters: left out), against the
    stage's counted ``kept`` bytes per microbatch."""
    stages = manifest["memory"]["stages"]
    wrapped = (manifest["plan"].get("mesh") or {}).get("dp", 1) > 1
    seen, left = set(), {}
    for label, _peak, delta in measured["actions"]:
        action = Action.parse(label) if " " not in label else None
        if action is None or action.kind != "F":
            continue
        first = action.stage not in seen
        seen.add(action.stage)
        if not (wrapped and first):
            left.setdefault(action.stage, []).append(delta)
    return [(stage, sum(deltas) / len(deltas), stages[stage]["kept"]) for stage, deltas in sorted(left.items())]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_peak_per_rank_within_ten_percent_of_the_measured(case, tmp_path, monkeypatch):
    name, family, world, options, layout, run = case
    monkeypatch.setenv("MEMORY_FAMILY", family)
    out = str(tmp_path / "out")
    manifest = split_model(model_path("memory_zoo"), out, layout=layout, run=run, **options)
    assert manifest["memory"]["notes"] == [], manifest["memory"]["notes"]
    report, saved = str(tmp_path / "memory.json"), str(tmp_path / "trained.pt")
    result = torchrun(out, world, "--steps", "2", "--quiet", "--measure-memory", report, "--save", saved,
                      env_extra={"MEMORY_FAMILY": family})
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-6000:]}"
    with open(report) as handle:
        measured = json.load(handle)
    assert measured["differs"] == [], measured["differs"]  # run.py defaulted to the split's run options
    problems = []
    for entry in measured["ranks"]:
        ratio = entry["ratio"]
        if abs(ratio - 1) > TOLERANCE:
            problems.append(f"rank {entry['rank']}: whole peak measured {entry['measured']['peak_bytes']} at "
                            f"{entry['measured'].get('at')}, predicted {entry['predicted']['peak_bytes']} at "
                            f"{entry['predicted']['at']} (ratio {ratio:.3f})")
        for stage, kept, predicted in _forward_kept(entry["measured"], manifest):
            if predicted and abs(kept / predicted - 1) > TOLERANCE:
                problems.append(f"rank {entry['rank']} stage {stage}: a forward kept {kept:.0f} bytes for "
                                f"backward, predicted {predicted} (ratio {kept / predicted:.3f})")
    assert not problems, f"{name}:\n" + "\n".join(problems)
    with open(os.path.join(out, "manifest.json")) as handle:
        assert json.load(handle)["run_options"] == run.to_json()
    if run.precision == "fp32":  # the checkpointing that the memory counts trains as eager does
        trained = torch.load(saved)
        assert_trained(trained, model_path("memory_zoo"))
        assert_state_close(trained, _eager(run.optimizer or "sgd", 2))


def _eager(optimizer: str, steps: int) -> dict:
    """The unsplit model trained on the same batches with run.py's optimizer (default lr, no weight decay)."""
    from tracepp.modelfile import load_model_file
    from tracepp.runtime.optim import build_optimizer

    model_file = load_model_file(model_path("memory_zoo"))
    module, model = model_file.module, model_file.model()
    built = build_optimizer(module, list(model.named_parameters()), name=optimizer, lr=0.01)
    for step in range(steps):
        args, kwargs, target = module.batch(step)
        module.loss_fn(model(*args, **kwargs), target).backward()
        built.step()
        built.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
