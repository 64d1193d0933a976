"""Tier 3: a stalled peer is reported in our words, and every live rank stops within about --timeout; a run that
succeeds ends without the watchdog in the way."""
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import model_path, torchrun


@pytest.mark.timeout(120)
def test_stalled_rank_is_named_and_every_live_rank_stops(tmp_path):
    out = str(tmp_path / "out")
    split_model(model_path("stall_on_step"), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    # rank 1 sleeps for an hour in batch(1): without the stall report this runs into the subprocess timeout
    result = torchrun(out, 2, "--steps", "3", "--timeout", "5", timeout=60)
    assert result.returncode != 0
    assert ("[tracepp rank 0] error: rank 0 waited 5 s for the gradient of microbatch 0 from rank 1 (stage 1): "
            "that rank stalled") in result.stderr, result.stderr[-3000:]
    assert "[tracepp rank 1] stopping because rank 0 failed: rank 0 waited 5 s" in result.stderr


CHILD = """
import os, sys, time
from datetime import timedelta
sys.path.insert(0, {root!r})
from runtime import failure

failure._POLL_S = 0.0  # no pause between polls: the watchdog is inside a store call at almost any instant


class SlowStore:  # each poll spends 20 ms inside a C++ store call, as a busy store's can
    def __init__(self, store):
        self.store = store

    def check(self, keys):
        try:
            self.store.wait(["never-set"], timedelta(milliseconds=20))
        except Exception:
            pass
        return False


channel = failure.FailureChannel(0, 2, 10.0)
channel.store = SlowStore(channel.store)
channel.start_watchdog()
time.sleep(0.1)
assert channel.stop(), "the watchdog did not end"
"""


@pytest.mark.timeout(120)
def test_watchdog_ends_before_interpreter_shutdown(tmp_path):
    """A run that succeeds exits 0: the watchdog thread is joined before the interpreter shuts down. Left
    running, it came back from a store call during shutdown and the rank aborted with SIGABRT ("terminate called
    without an active exception"), which failed a 2-rank training run in CI."""
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master.port))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=root))
    for _ in range(3):
        result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
