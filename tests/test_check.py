"""`tracepp check` (and `split --dry-run`) trace, split and plan, print the table and warnings, write nothing."""
import os

import pytest

from tracepp.report.checks import stage_warnings
from tracepp.cli import main
from util import model_path


@pytest.mark.parametrize("argv", [["check"], ["split", "--dry-run", "-o", "out"]])
def test_check_prints_warnings_and_writes_nothing(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, model_path("check_warnings"), "--ranks", "2", "--schedule", "interleaved-1f1b"]) == 0
    printed = capsys.readouterr().out
    assert os.listdir(tmp_path) == []
    assert "stage    rank    params" in printed
    assert ("warning: stage 3 has no parameters (act): it only passes values on; merge it with a neighbour by "
            "removing the split point that starts it") in printed
    assert "warning: value 'gate' from stage 0 is sent to 3 stages (1, 2, 3) every microbatch" in printed
    assert "nothing written" in printed


def _stage(index, num_params, flops):
    return {"index": index, "num_params": num_params, "forward_flops": flops, "module_fqns": [f"m{index}"]}


def test_unbalanced_stages_are_named_with_their_numbers():
    manifest = {"stages": [_stage(0, 100, 1000), _stage(1, 450, 1500)], "values": {}}
    assert stage_warnings(manifest) == [
        "unbalanced stages: stage 1 has 4.5x the parameters of stage 0 (450 vs 100); the pipeline runs at the pace "
        "of its slowest stage: move a split point (--split-points) so each stage holds a similar share"]
    balanced = {"stages": [_stage(0, 100, 1000), _stage(1, 150, 1500)], "values": {}}
    assert stage_warnings(balanced) == []
