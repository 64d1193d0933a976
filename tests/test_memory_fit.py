"""Fits means fits (issue 59), tier 1: the fit check of run.py and ``Pipeline(folder)`` on plain data: the run options a
job runs with (the split's unless given, a differing one named), the CUDA reserve (a documented default, a flag), the
CPU check that refuses a host whose ranks cannot hold their peaks (unless --memory-check warn), and a rank whose
figure is a bound saying so."""
from types import SimpleNamespace

import pytest
import torch

from tracepp.runtime import memory_fit
from tracepp.runtime.failure import PipelineError
from tracepp.runtime.mesh import Layout
from tracepp.runtime.run_options import RunOptions, chosen

MB = 10**6


def _manifest(peaks, bound=(), **run):
    ranks = [{"peak_bytes": peak, "at": f"{r}B0", "parts": {"activations": peak}, "rings_bytes": 0,
              **({"bound": True, "bound_stages": [r]} if r in bound else {})} for r, peak in enumerate(peaks)]
    return {"memory": {"ranks": ranks, "alternatives": {"full": [p // 2 for p in peaks]}},
            "run_options": RunOptions(**run).to_json(), "plan": {"stage_to_rank": list(range(len(peaks)))}}


def _pipe(manifest, device="cpu", rank=0, world=1):
    return SimpleNamespace(manifest=manifest, training=True, rank=rank, pp_rank=rank, world_size=world,
                           device=torch.device(device), layout=Layout(pp=len(manifest["memory"]["ranks"])),
                           user=SimpleNamespace())


def test_the_run_options_are_the_splits_unless_given_and_a_differing_one_is_named():
    manifest = _manifest([MB], precision="bf16", activation_checkpointing="selective,none", optimizer="adamw")
    run, differs = chosen(manifest)
    assert (run.precision, run.activation_checkpointing, differs) == ("bf16", "selective,none", [])
    run, differs = chosen(manifest, precision="bf16", activation_checkpointing=None)  # the same: nothing to name
    assert differs == []
    run, differs = chosen(manifest, precision="fp32", optimizer="sgd")
    assert run.precision == "fp32" and run.activation_checkpointing == "selective,none"
    assert differs == ["precision fp32 (planned bf16)", "optimizer sgd (planned adamw)"]
    assert chosen({"run_options": None}, optimizer="sgd")[1] == []  # an old folder: fp32, none, sgd


@pytest.mark.parametrize("text, expected", [("2GB", (2 * 10**9, 0.0)), ("10%", (0, 0.10)),
                                            ("1.5GiB+5%", (int(1.5 * 2**30), 0.05)), ("512MB", (512 * MB, 0.0))])
def test_the_cuda_reserve_is_a_size_a_share_of_the_peak_or_both(text, expected):
    fixed, fraction = memory_fit.parse_reserve(text)
    assert fixed == expected[0] and fraction == pytest.approx(expected[1])
    assert memory_fit.parse_reserve(None) == memory_fit.parse_reserve(memory_fit.CUDA_RESERVE)  # the default
    with pytest.raises(PipelineError, match="--memory-reserve '2 apples': give a size"):
        memory_fit.parse_reserve("2 apples")


def test_cuda_keeps_the_reserve_free_and_stops_naming_the_figures(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * gib)
    pipe = _pipe(_manifest([9 * gib]), device="cuda")
    memory_fit.check(pipe, reserve="1GB")  # 9 GiB + 1 GB within 11 GiB: runs
    with pytest.raises(PipelineError) as refused:  # the default reserve, 2 GB + 11% of the peak, does not fit
        memory_fit.check(pipe)
    text = str(refused.value)
    assert "needs 9.66 GB at its peak" in text and "--memory-reserve 2GB+11%" in text
    assert "can give 11.81 GB" in text and "`--activation-checkpointing full`" in text
    memory_fit.check(pipe, mode="warn")  # warns, runs


def test_cpu_refuses_a_host_whose_ranks_cannot_hold_their_peaks_unless_warn(monkeypatch, capsys):
    monkeypatch.setattr(memory_fit, "available_ram", lambda: 100 * MB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    manifest = _manifest([70 * MB, 40 * MB])
    manifest["memory"]["ranks"][1]["rings_bytes"] = 16 * MB
    pipe = _pipe(manifest, world=2)
    monkeypatch.setattr(memory_fit.dist, "all_reduce", lambda flag: None)  # one process plays rank 0
    with pytest.raises(PipelineError) as refused:
        memory_fit.check(pipe)
    text = str(refused.value)
    assert "the 2 ranks on this host need 126.00 MB" in text and "100.00 MB of RAM is available" in text
    assert "Pass --memory-check warn to run anyway" in text
    memory_fit.check(pipe, mode="warn")
    assert "warning: the 2 ranks on this host need 126.00 MB" in capsys.readouterr().err
    memory_fit.check(pipe, mode="off")
    monkeypatch.setattr(memory_fit, "available_ram", lambda: 200 * MB)
    memory_fit.check(pipe)  # fits


def test_a_bound_is_said_to_be_one(monkeypatch):
    monkeypatch.setattr(memory_fit, "available_ram", lambda: 10 * MB)
    pipe = _pipe(_manifest([70 * MB], bound=(0,)))
    with pytest.raises(PipelineError, match=r"need 70.00 MB at their peaks \(a bound: a stage's memory could not be "
                                            r"counted\)"):
        memory_fit.check(pipe)


def test_options_that_differ_skip_the_check_and_are_named_once(monkeypatch, capsys):
    monkeypatch.setattr(memory_fit, "available_ram", lambda: 10 * MB)
    pipe = _pipe(_manifest([70 * MB]))
    # named already (by the Pipeline): silent; the optimizer run.py builds, named here
    memory_fit.check(pipe, differs=["precision fp32 (planned bf16)"])
    assert capsys.readouterr().err == ""
    memory_fit.check(pipe, differs=["precision fp32 (planned bf16)", "optimizer adamw (planned sgd)"],
                     unnamed=["optimizer adamw (planned sgd)"])
    out = capsys.readouterr().err
    assert "optimizer adamw (planned sgd)" in out and "precision" not in out
