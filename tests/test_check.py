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


RANDOM_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = F.dropout(self.a(x), p=0.0, training=True)  # draws nothing
        q = x.view(x.shape[0], 1, 2, 4)
        x = x + F.scaled_dot_product_attention(q, q, q).reshape(x.shape)  # dropout_p 0: draws nothing
        x = F.dropout(x, p=0.25, training=True)
        return self.b(x * torch.rand_like(x))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)


def example_target():
    return torch.zeros(4, 8)


def loss_fn(out, target):
    return (out - target).pow(2).mean()
'''


def test_random_ops_are_named_with_their_lines(tmp_path, capsys):
    """A model that draws random numbers cannot equal eager number for number once pipelined (each rank draws
    its own, a microbatch at a time): the split names each op that draws (and not those whose probability is
    0) with its line, so a user comparing with eager knows why."""
    path = tmp_path / "random_model.py"
    path.write_text(RANDOM_MODEL)
    assert main(["check", str(path), "--ranks", "2"]) == 0
    printed = capsys.readouterr().out
    note = next(line for line in printed.splitlines() if "draws random numbers" in line)
    assert "(2 op(s): aten.dropout at random_model.py:16, aten.rand_like at random_model.py:17)" in note, note
    assert "equals eager in distribution, not number for number" in note


@pytest.mark.parametrize("mix", ["gather", "center", "none", "cached"])
def test_a_model_whose_samples_mix_across_the_batch_is_warned_of(mix, monkeypatch, capsys):
    # mixture-of-attention 0.0.25's router gives sample i the tokens of sample i // 2: its eager whole batch and its
    # pipelined microbatches computed different functions, and the split said nothing (0.8 apart in the logits)
    monkeypatch.setenv("MIX", mix)
    assert main(["check", model_path("batch_mixing"), "--ranks", "2", "--microbatches", "2"]) == 0
    captured = capsys.readouterr()
    said = "the model's output for a sample depends on the other samples of its batch"
    if mix in ("none", "cached"):
        assert said not in captured.err and "0 warning(s)" in captured.out
    else:
        assert f"warning: {said}: run on the example batch of 4 whole and as 2 microbatches of 2" in captured.err
        assert "1 warning(s)" in captured.out


def test_a_model_that_draws_random_numbers_the_trace_does_not_see_is_no_finding():
    # reformer-pytorch's reversible LSH draws its rotations inside an autograd.Function: its whole batch and its
    # microbatches differ for that alone. The whole batch run twice gives two answers: no finding (the first version
    # warned that its samples mixed); a model that does mix them is still found
    import torch
    import torch.utils._pytree as pytree

    from tracepp import batch_mixing

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.randn_like(x)

    class Centred(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(dim=0, keepdim=True)

    x = torch.randn(4, 3)
    leaves, spec = pytree.tree_flatten(((x,), {}))
    found = []
    for module in (Noisy(), Centred()):
        program = torch.export.export(module, (x[:2],))
        found.append(batch_mixing.check(batch_mixing.probe(module, 2, 4), program, leaves, spec, [True], 4, 2))
    assert found[0] is None and "depends on the other samples of its batch" in found[1]
    # where three more forwards of the example batch would take long (parameters x batch elements over the budget),
    # the model is not run again
    assert batch_mixing.probe(Centred(), 2, 4, elements=10 ** 12) is not None  # no parameters: nothing to run long
    big = torch.nn.Linear(1000, 1000)
    assert batch_mixing.probe(big, 2, 4, elements=4 * 10 ** 4) is None and batch_mixing.probe(big, 2, 4, 16) is not None
