"""Tier 3: the rank script is the program. An edited script either runs as edited or every rank stops, naming the
file, the line and the rule broken (``runtime/script_check.py``)."""
from __future__ import annotations

import os

import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import assert_state_close, eager_train, model_path, run_ok, torchrun

STEPS = 2


def _split(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("residual_mlp_lm"), out, schedule="1f1b", num_microbatches=4,
                split_points=["layers.2"], layout=Layout(pp=2))
    return out


def _edit(out: str, rank: int, old: str, new: str) -> str:
    path = os.path.join(out, f"rank{rank}.py")
    with open(path) as handle:
        text = handle.read()
    assert text.count(old) == 1, f"{old!r} not found once in {path}"
    with open(path, "w") as handle:
        handle.write(text.replace(old, new))
    return path


def test_valid_edit_trains_as_edited_and_equals_eager(tmp_path):
    """Rank 0 runs forward 1 before sending forward 0's activation (two independent adjacent actions swapped) and
    its RELEASES are deleted (every send waited on at the step end): valid, so it trains, equal to eager."""
    out = _split(tmp_path)
    _edit(out, 0, '    "0F0", "0SEND_F0>1",\n    "0F1", "0SEND_F1>1",\n',
          '    "0F0",\n    "0F1", "0SEND_F0>1", "0SEND_F1>1",\n')
    path = os.path.join(out, "rank0.py")
    text = open(path).read()
    start = text.index("RELEASES = {")
    open(path, "w").write(text[:start] + text[text.index("}\n", start) + 2:])
    ckpt = str(tmp_path / "ckpt.pt")
    result = run_ok(out, 2, "--steps", str(STEPS), "--save", ckpt)
    assert ("[tracepp] note: rank0.py differs from the plan tracepp wrote; the gathered plan was validated and runs "
            "as edited") in result.stdout
    assert_state_close(torch.load(ckpt), eager_train(model_path("residual_mlp_lm"), STEPS))


def test_broken_edit_stops_every_rank_naming_file_and_line(tmp_path):
    """Rank 1 runs backward 0 before its own forward 0: refused before the first step, on every rank."""
    out = _split(tmp_path)
    path = _edit(out, 1, '    "1RECV_F0<0", "1F0",\n    "1RECV_F1<0", "1B0", "1SEND_B0>0",\n',
                 '    "1RECV_F0<0", "1B0", "1F0",\n    "1RECV_F1<0", "1SEND_B0>0",\n')
    line = next(n for n, text in enumerate(open(path).read().splitlines(), 1) if '"1B0", "1F0"' in text)
    result = torchrun(out, 2, "--steps", str(STEPS))
    assert result.returncode != 0
    message = (f"[tracepp] error: rank1.py line {line}: action '1B0' (ACTIONS[1]): needs '1F0' (action 2) to run "
               f"first; move it before action 1 [the plan in the rank scripts (rank1.py edited) breaks this rule, so "
               f"no rank starts")
    assert message in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("[tracepp] error:") == 1  # one message, from rank 0
    assert "step 1/" not in result.stdout
