"""Tier 3: a stalled peer is reported in our words, and every live rank stops within about --timeout."""
import pytest

from tracepp.driver import split_model
from util import model_path, torchrun


@pytest.mark.timeout(120)
def test_stalled_rank_is_named_and_every_live_rank_stops(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("stall_on_step"), out, num_ranks=2, schedule="1f1b", num_microbatches=2)
    # rank 1 sleeps for an hour in batch(1): without the stall report this runs into the subprocess timeout
    result = torchrun(out, 2, "--steps", "3", "--timeout", "5", timeout=60)
    assert result.returncode != 0
    assert ("[tracepp rank 0] error: rank 0 waited 5 s for the gradient of microbatch 0 from rank 1 (stage 1): "
            "that rank stalled") in result.stderr, result.stderr[-3000:]
    assert "[tracepp rank 1] stopping because rank 0 failed: rank 0 waited 5 s" in result.stderr
