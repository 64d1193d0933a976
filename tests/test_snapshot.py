"""Snapshots of generated rank scripts, so naming or layout drift shows up in review.

* ``residual_mlp_lm_rank1``: a 1F1B stage whose two blocks call one block function;
* ``tied_lm_v_rank0``: a V placement (zbv) rank holding the first and the last stage, which share the block
  function and each read the tied weight by their own module's name (``p_embed_weight``, ``p_head_weight``);
* ``dynamic_seq_lm_rank1``: dynamic batch and sequence dims (``s_batch``, ``s_seq``) in annotations, sizes
  and ``boundary_shapes``.

Regenerate after an intended change with: TRACEPP_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_snapshot.py
"""
import os
import re

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import HERE, model_path

CASES = {
    "residual_mlp_lm_rank1": ("residual_mlp_lm", 1, dict(layout=Layout(pp=2), schedule="1f1b", num_microbatches=2,
                                                        split_points=["layers.2"])),
    "tied_lm_v_rank0": ("tied_lm_v", 0, dict(layout=Layout(pp=2), schedule="zbv", num_microbatches=4)),
    "dynamic_seq_lm_rank1": ("dynamic_seq_lm", 1, dict(layout=Layout(pp=2), schedule="1f1b", num_microbatches=2)),
}


def normalise(text: str, out_dir: str) -> str:
    text = text.replace(out_dir, "OUT")
    text = re.sub(r"\(sha256 [0-9a-f]+\)", "(sha256 HASH)", text)
    return re.sub(r"\(torch [^)]*\)", "(torch VERSION)", text)


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="fx's code generator output is pinned to torch 2.13")
@pytest.mark.parametrize("snapshot", sorted(CASES))
def test_rank_script_snapshot(tmp_path, snapshot):
    model, rank, options = CASES[snapshot]
    out = str(tmp_path / "out")
    split_model(model_path(model), out, **options)
    generated = normalise(open(os.path.join(out, f"rank{rank}.py")).read(), out)
    path = os.path.join(HERE, "snapshots", f"{snapshot}.py.txt")
    if os.environ.get("TRACEPP_UPDATE_SNAPSHOTS"):
        with open(path, "w") as handle:
            handle.write(generated)
    expected = open(path).read()
    assert generated == expected, f"generated rank{rank}.py changed; review the diff and regenerate {path}"
