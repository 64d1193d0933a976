"""Memory you can plan on (issues 46, 59), tier 3: each rank's peak predicted at split time (counted on fake tensors,
walked over the plan's timeline) against the peak the run measures with a meter that shares no code with the count
(``run.py --measure-memory``: torch's MemTracker on CPU), within 10%; and what each forward keeps for backward, per
microbatch, against what the run's forwards left; fp32 runs trained equal to eager; and a loop of one's own through
``Pipeline(folder)`` runs the precision and checkpointing the split planned.

Seven cases of ``benchmarks/memory_check.py``'s matrix (the rest run there): dense Llama, GPT-2, Mixtral and a small
DeepSeek-V3; fp32 and bf16 (``--mixed-precision params``: fp32 masters, the bf16 copy a stage computes with, FSDP
gathering it in bf16 and reducing in fp32); activation checkpointing none, full, selective and every-2; GPipe, 1F1B,
interleaved and zero-bubble; FSDP over ``--dp 2``, ``--tp 2 --sequence-parallel``, ``--cp 2`` and ``--dp 2 --ep 2``;
SGD and AdamW.
"""
import json
import os

import pytest
import torch

from benchmarks.memory_check import MODEL, _cases, check_case
from util import HERE, TORCHRUN_TIMEOUT_S, assert_state_close, assert_trained, start_ranks, torchrun

pytestmark = pytest.mark.timeout(600)
CASES = ["llama-gpipe-bf16-full-adamw", "gpt2-interleaved-zero-bubble-fp32-selective", "deepseek_v3-1f1b-fp32-none",
         "llama-fsdp-dp2-interleaved-fp32-adamw", "llama-tp2-sequence-parallel-1f1b-bf16-selective",
         "mixtral-dp2-ep2-1f1b-fp32", "llama-fsdp-dp2-1f1b-bf16-adamw", "llama-cp2-1f1b-adamw"]


def _launch(out: str, world: int, args: list, env: dict) -> tuple:
    result = torchrun(out, world, *args, env_extra=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("name", CASES)
def test_peak_per_rank_within_ten_percent_of_the_measured(name, tmp_path, monkeypatch):
    case = _cases()[name]
    monkeypatch.setenv("MEMORY_FAMILY", case[0])
    record = check_case(name, case, str(tmp_path), _launch)
    assert record["returncode"] == 0, record.get("error")
    assert record["notes"] == [], record["notes"]  # every stage counted on fake tensors
    assert record["differs"] == [], record["differs"]  # run.py defaulted to the split's run options
    assert record["ok"], f"{name}:\n" + "\n".join(record["problems"])
    with open(os.path.join(str(tmp_path), name, "manifest.json")) as handle:
        assert json.load(handle)["run_options"] == case[4].to_json()
    run = case[4]
    if run.precision == "fp32":  # the checkpointing that the memory counts trains as eager does
        trained = torch.load(record["saved"])
        assert_trained(trained, MODEL)
        # AdamW divides each gradient by its own running RMS: FSDP's reduce-scatter sums the replicas' gradients in
        # another order than eager's one backward, and on a near-zero gradient that rounding moves the update by a
        # few thousandths of lr (0.01): CI saw 2.07e-5 on one weight of the FSDP case. SGD stays at 2e-5
        atol = 5e-5 if run.optimizer == "adamw" else 2e-5
        assert_state_close(trained, _eager(run.optimizer or "sgd", 2), atol=atol)


def _eager(optimizer: str, steps: int) -> dict:
    """The unsplit model trained on the same batches with run.py's optimizer (default lr, no weight decay)."""
    from tracepp.modelfile import load_model_file
    from tracepp.runtime.optim import build_optimizer

    model_file = load_model_file(MODEL)
    module, model = model_file.module, model_file.model()
    built = build_optimizer(module, list(model.named_parameters()), name=optimizer, lr=0.01)
    for step in range(steps):
        args, kwargs, target = module.batch(step)
        module.loss_fn(model(*args, **kwargs), target).backward()
        built.step()
        built.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_loop_of_ones_own_runs_the_split_it_was_planned_for(tmp_path, monkeypatch):
    """Issue 59: a folder split with bf16 + selective checkpointing, trained through ``Pipeline(folder)`` as the
    guide's own loop does (tests/own_loop_measured.py): every rank runs bf16, recomputes in backward, and holds its
    planned peak within 10% on torch's MemTracker. Before, the Pipeline ran fp32 with nothing recomputed (1.21 -
    1.49 x the plan)."""
    from tracepp.driver import split_model
    from tracepp.runtime.mesh import Layout
    from tracepp.runtime.run_options import RunOptions

    monkeypatch.setenv("MEMORY_FAMILY", "llama")
    out, prefix = str(tmp_path / "out"), str(tmp_path / "loop")
    split_model(MODEL, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2),
                run=RunOptions(precision="bf16", activation_checkpointing="selective", optimizer="adamw"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = start_ranks([os.path.join(HERE, "own_loop_measured.py"), out, prefix], 2, env, TORCHRUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "not those tracepp split planned" not in result.stdout + result.stderr
    for rank in range(2):
        with open(f"{prefix}.rank{rank}.json") as handle:
            record = json.load(handle)
        assert record["precision"] == "bf16"
        assert record["checkpointing"] == {str(rank): "selective"}
        assert record["recomputed"] > 0, record  # RMSNorm's rsqrt ran again in backward
        assert "MemTracker" in record["method"]
        assert abs(record["ratio"] - 1) <= 0.10, record
