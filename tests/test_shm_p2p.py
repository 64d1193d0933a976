"""Tier 1: the shared-memory transport's rings, in one process (two transports as the two ranks of a pair)."""
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from tracepp.runtime import shm_p2p
from tracepp.runtime.failure import PipelineError

pytestmark = pytest.mark.skipif(shm_p2p.available() is not None, reason=str(shm_p2p.available()))


def _pair(capacity: int):
    """(rank 0's transport, rank 1's): a ring each way, mapped twice in this process, the files already gone."""
    token = uuid.uuid4().hex[:8]
    paths = [f"/dev/shm/tracepp-test-{token}-{direction}" for direction in ("0to1", "1to0")]
    to_one = shm_p2p.Ring(paths[0], capacity, create=True)
    to_zero = shm_p2p.Ring(paths[1], capacity, create=True)
    zero = shm_p2p.SharedMemoryP2P(0, {1: shm_p2p.Ring(paths[0], capacity, create=False)}, {1: to_zero})
    one = shm_p2p.SharedMemoryP2P(1, {0: shm_p2p.Ring(paths[1], capacity, create=False)}, {0: to_one})
    for path in paths:
        os.unlink(path)
    return zero, one


def _until(works, *transports, limit=10000):
    for _ in range(limit):
        if all(w.done for w in works):
            return
        for transport in transports:
            transport.progress()
    raise AssertionError("messages did not arrive")


def test_messages_match_receives_by_tag_in_posting_order():
    zero, one = _pair(1 << 16)
    a, b, c = torch.arange(6.0).reshape(2, 3), torch.tensor([7, 8], dtype=torch.int64), torch.full((2, 3), -1.0)
    sends = [zero.isend(a, 1, tag=5), zero.isend(b, 1, tag=6), zero.isend(c, 1, tag=5)]
    assert all(w.done for w in sends)  # copied into the ring at once: the sender's tensors may go
    got_b, first, second = torch.empty(2, dtype=torch.int64), torch.empty(2, 3), torch.empty(2, 3)
    works = [one.irecv(got_b, 0, tag=6), one.irecv(first, 0, tag=5), one.irecv(second, 0, tag=5)]
    assert all(w.wait(1.0) for w in works)
    assert torch.equal(got_b, b) and torch.equal(first, a) and torch.equal(second, c)


def test_a_receive_posted_before_the_send_and_the_other_direction():
    zero, one = _pair(1 << 16)
    target = torch.empty(3, dtype=torch.bool)
    work = one.irecv(target, 0, tag=1)
    assert not work.done
    zero.isend(torch.tensor([True, False, True]), 1, tag=1)
    assert work.wait(1.0) and target.tolist() == [True, False, True]
    back = torch.empty(4)
    one.isend(torch.ones(4), 0, tag=2)
    assert zero.irecv(back, 1, tag=2).wait(1.0) and back.tolist() == [1.0] * 4


def test_a_message_larger_than_the_ring_streams_through_and_keeps_the_order_behind_it():
    zero, one = _pair(256)
    big = torch.randn(1000)  # 4000 bytes through a 256-byte ring
    small, empty = torch.tensor([3.0]), torch.empty(0)
    sends = [zero.isend(big, 1, tag=1), zero.isend(small, 1, tag=2), zero.isend(empty, 1, tag=3)]
    assert not sends[0].done  # the rest moves when the ranks wait or post
    got_big, got_small, got_empty = torch.empty(1000), torch.empty(1), torch.empty(0)
    works = [one.irecv(got_empty, 0, tag=3), one.irecv(got_small, 0, tag=2), one.irecv(got_big, 0, tag=1)]
    _until(works + sends, zero, one)
    assert torch.equal(got_big, big) and torch.equal(got_small, small)


def test_a_receive_posted_while_its_message_streams_in_unmatched():
    zero, one = _pair(256)
    big = torch.randn(300)
    send = zero.isend(big, 1, tag=9)
    one.progress()  # the first piece arrives with no receive posted: copied aside as it comes
    assert not send.done
    got = torch.empty(300)
    work = one.irecv(got, 0, tag=9)
    _until([work, send], zero, one)
    assert torch.equal(got, big)


def test_a_size_the_plan_does_not_expect_names_both_ranks_and_both_sizes():
    zero, one = _pair(1 << 12)
    zero.isend(torch.zeros(4), 1, tag=3)
    with pytest.raises(PipelineError, match=r"rank 1 received a message of 16 bytes from rank 0 \(tag 3\) where "
                                            r"its plan expects 32 bytes"):
        one.irecv(torch.empty(8), 0, tag=3).wait(1.0)


def test_a_wait_runs_out_at_its_timeout():
    zero, one = _pair(1 << 12)
    start = time.perf_counter()
    assert one.irecv(torch.empty(2), 0, tag=1).wait(0.05) is False
    assert 0.05 <= time.perf_counter() - start < 1.0


def test_a_sender_that_exited_is_reported_within_a_second():
    zero, one = _pair(1 << 12)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ring = one.incoming[0].ring
    ring.words[1] = int(gone.stdout)  # the sender's pid word, as if that process had made the ring
    start = time.perf_counter()
    with pytest.raises(PipelineError, match=rf"rank 0 \(process {int(gone.stdout)}\) exited while rank 1 waited"):
        one.irecv(torch.empty(2), 0, tag=1).wait(30.0)
    assert time.perf_counter() - start < 2.0


def test_ring_pages_are_mapped_before_the_first_message():
    """A page of the ring first written in the middle of a run cost a sender about 14 us (a 64 KB send 0.22 ms
    instead of 0.01 ms, for the whole first pass through the ring): both ends fault every page in when they
    map the ring, so streaming a full ring's worth of messages through faults (almost) no page in."""
    resource = pytest.importorskip("resource")
    capacity = 1 << 20
    path = f"/dev/shm/tracepp-test-{uuid.uuid4().hex[:8]}"
    receiver = shm_p2p.Ring(path, capacity, create=True)
    sender = shm_p2p.Ring(path, capacity, create=False)
    os.unlink(path)
    message = torch.arange(1 << 14, dtype=torch.float32).view(torch.uint8)  # 64 KB
    target = torch.empty_like(message)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for position in range(0, capacity, message.numel()):
        sender.copy_in(position, message.data_ptr(), message.nbytes)
        receiver.copy_out(position, target.data_ptr(), target.nbytes)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert torch.equal(target, message)
    assert faults < capacity // 4096 // 8, f"{faults} page faults streaming {capacity >> 20} MB through the ring"


def test_connect_in_one_process_world_makes_no_rings(tmp_path):
    """A rank with no peers (and --p2p gloo) gets no transport."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert shm_p2p.connect(0, set(), set(), 1 << 20, "auto") == (None, None)
        assert shm_p2p.connect(0, set(), set(), 1 << 20, "gloo") == (None, None)
        with pytest.raises(ValueError, match="--p2p must be one of auto, shm, gloo"):
            shm_p2p.connect(0, set(), set(), 1 << 20, "tcp")
    finally:
        dist.destroy_process_group()
