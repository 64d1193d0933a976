"""Snapshot of a generated rank script, so naming or layout drift shows up in review.

Regenerate after an intended change with: TRACEPP_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_snapshot.py
"""
import os
import re

import pytest
import torch

from tracepp.driver import split_model
from util import HERE, model_path

SNAPSHOT = os.path.join(HERE, "snapshots", "residual_mlp_lm_rank1.py.txt")


def normalise(text: str, out_dir: str) -> str:
    text = text.replace(out_dir, "OUT")
    return re.sub(r"\(torch [^)]*\)", "(torch VERSION)", text)


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="fx's code generator output is pinned to torch 2.13")
def test_rank_script_snapshot(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("residual_mlp_lm"), out, num_ranks=2, schedule="1f1b", num_microbatches=2,
                split_points=["layers.2"])
    generated = normalise(open(os.path.join(out, "rank1.py")).read(), out)
    if os.environ.get("TRACEPP_UPDATE_SNAPSHOTS"):
        with open(SNAPSHOT, "w") as handle:
            handle.write(generated)
    expected = open(SNAPSHOT).read()
    assert generated == expected, "generated rank1.py changed; review the diff and regenerate the snapshot"
