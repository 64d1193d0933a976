"""Unit tests of run.py's CPU memory hygiene (runtime/host_memory.py) and the fused AdamW of --optimizer adamw."""
import types

import pytest
import torch

from tracepp.runtime import host_memory
from tracepp.runtime.optim import build_optimizer, fused_supported

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="needs glibc 2.33+ (mallinfo2)")


def _rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS"))


def test_release_returns_freed_heap_pages_to_the_os():
    assert host_memory.configure(torch.device("cpu"))
    # 200 MB of 512 KiB blocks (below the mmap threshold: heap), written so their pages are resident, then freed
    blocks = [torch.ones(128 * 1024) for _ in range(400)]
    blocks = blocks[1::2]  # free every other one: holes in the heap that no trim at its top can return
    assert host_memory.free_heap_bytes() > host_memory.TRIM_ABOVE
    before = _rss_bytes()
    assert host_memory.release(torch.device("cpu"))
    assert before - _rss_bytes() > 50e6, "malloc_trim returned less than 50 MB of the 100 MB freed"
    del blocks


def test_a_step_reuses_its_heap_pages_instead_of_faulting_them_in_again():
    """Fixing the mmap threshold froze glibc's trim threshold at 128 KiB: each step gave the top of the heap back
    and faulted it in again (1400 - 1900 page faults per step per rank in the quick suite's ZB case)."""
    resource = pytest.importorskip("resource")
    assert host_memory.configure(torch.device("cpu"))

    def step():  # activations of a small stage: 3 MB of 256 KiB blocks, allocated, written, freed
        blocks = [torch.ones(64 * 1024) for _ in range(12)]
        del blocks

    step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        step()
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    # 1930 without the trim threshold (the freed top of the heap given back each step); a few dozen with it
    assert faults < 400, f"{faults} page faults in 10 steps that reuse the same 3 MB"


def test_off_switch_and_gpu_ranks_leave_the_allocator_alone(monkeypatch):
    assert not host_memory.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRACEPP_HOST_MEMORY", "off")
    assert not host_memory.configure(torch.device("cpu")) and not host_memory.release(torch.device("cpu"))


def test_flag_adamw_is_fused_and_equals_the_default_implementation():
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    fused = build_optimizer(types.SimpleNamespace(), list(models[0].named_parameters()), name="adamw", lr=0.01,
                            weight_decay=0.1)
    assert fused.defaults["fused"] and fused_supported(list(models[0].parameters()))
    plain = torch.optim.AdamW([{"params": [models[1][0].weight], "weight_decay": 0.1},
                               {"params": [models[1][0].bias, *models[1][1].parameters()], "weight_decay": 0.0}],
                              lr=0.01)
    for step in range(5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, optimizer in zip(models, (fused, plain)):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # another order of fp32 ops
