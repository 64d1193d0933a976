"""Tier 2: generated stage code follows the rank's device instead of the device the model was traced on.

Export bakes ``device=cpu`` into factory calls such as ``torch.arange(T, device=idx.device)``; the rank script
routes them through its ``RUN_DEVICE`` global, which the runtime sets to the rank's device (``cuda:N`` under
NCCL). CI has no GPU, so the check runs the stage on the ``meta`` device: a factory op that still said
``cpu`` would mix devices and fail exactly as it did on a GPU.
"""
import json
import os

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.fixture(scope="module")
def gpt_folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpt") / "out")
    split_model(os.path.join(EXAMPLES, "gpt.py"), out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2))
    return out


def test_factory_ops_read_the_run_device(gpt_folder):
    source = open(os.path.join(gpt_folder, "rank0.py")).read()
    assert "device = RUN_DEVICE" in source  # torch.arange of the positions
    assert "device(type='cpu')" not in source


def test_positional_devices_follow_too(tmp_path):
    """HF's rotary embedding does ``inv_freq.to(x.device)``: export records ``aten.to.device(x, cpu, ...)``."""
    out = str(tmp_path / "out")
    models = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
    split_model(os.path.join(models, "hf_llama.py"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    for rank in range(2):
        source = open(os.path.join(out, f"rank{rank}.py")).read()
        code = "\n".join(line for line in source.splitlines() if not line.strip().startswith("#"))
        assert "device(type='cpu')" not in code, f"rank{rank}.py still names the trace's device"
    assert "aten.to.device(" in open(os.path.join(out, "rank0.py")).read()
    # export's dtype/device checks of .to() calls would fail under bf16 autocast and on another device
    assert "_assert_tensor_metadata" not in open(os.path.join(out, "rank0.py")).read()


def test_stage_runs_on_the_device_the_runtime_sets(gpt_folder):
    from tracepp.runtime import Pipeline

    with open(os.path.join(gpt_folder, "manifest.json")) as handle:
        manifest = json.load(handle)
    device = torch.device("meta")
    pipe = Pipeline(gpt_folder, rank=0, device=device)
    stage = pipe.stages[0]
    assert stage.function.__globals__["RUN_DEVICE"] == device
    assert all(p.device.type == "meta" for p in stage.parameters())
    idx = torch.zeros(manifest["root_inputs"][0]["shape"], dtype=torch.int64, device=device)
    (out,) = stage(idx)
    assert out.device.type == "meta"
