"""Pipeline messages between CPU ranks on one host through shared memory instead of gloo's sockets.

Why: gloo hands a message to its I/O threads, which need their core's time slice while that core is busy
with the rank's compute; two ranks on 2 cores that compute and then exchange 16 KB lose about 1 ms per
exchange that way, against about 0.1 ms here (``python -m benchmarks.studies.exchange_cost``, README "Benchmarks").

How: one ring buffer per directed pair of ranks that exchange pipeline messages, a file in ``/dev/shm``
mapped by both processes and unlinked as soon as both have it, so nothing outlives the job. The sender copies
a message (a 64-byte header with its tag and size, then the payload padded to 64 bytes) into the ring in its
own thread and publishes the new write position; the receiver copies it out when it waits, matching
messages to receives by tag in posting order, as gloo does (a message whose receive is not posted yet is
copied aside). No thread, no system call per message. A message larger than the free space streams through
in pieces, moved on whenever either rank waits or posts. A waiting rank polls the write position (with a core of
its own, ``cpu_binding.has_own_core``: spinning for 0.2 ms, then yielding its core, then in naps of 50 us after
2 ms; sharing cores with other ranks: naps after 20 us), checks that the sending process still exists, and
gives up at the timeout like a gloo wait.

The positions are 8-byte aligned words written by one side each; x86-64 keeps a core's stores in program
order for the others, so a published position never runs ahead of the bytes it covers. Other architectures
use gloo (``available``).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import socket
import time
import uuid
from collections import deque
from datetime import timedelta

import torch

from .failure import PipelineError

ALIGN = 64  # header size, and the alignment of every message: a header never wraps around the ring
_CONTROL = 256  # words: [0] write position, [1] writer pid; [8] read position, [9] reader pid
_WRITE, _WRITER_PID, _READ, _READER_PID = 0, 1, 8, 9
_SHM_DIR = "/dev/shm"
DEFAULT_RING_MB = 16
MODES = ("auto", "shm", "gloo")


def available() -> str:
    """None where the shared-memory transport can run here, else why not (one line)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the shared-memory transport needs x86-64 (this is {platform.machine()})"
    if not os.path.isdir(_SHM_DIR) or not os.access(_SHM_DIR, os.W_OK):
        return f"{_SHM_DIR} is missing or not writable"
    return None


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_memmove = ctypes.memmove  # one C call per copy: no tensor views, no dispatcher (see Ring.copy_in)


class Ring:
    """One direction of one rank pair: a mapped ``/dev/shm`` file, control words then ``capacity`` bytes."""

    def __init__(self, path: str, capacity: int, create: bool):
        size = _CONTROL + capacity
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # reserve the pages now: a full /dev/shm fails here, not later
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.capacity = capacity
        self.words = memoryview(self._map).cast("q")
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_CONTROL, count=capacity)
        self.base = self.data.data_ptr()  # the address of the data's first byte in this process
        self._map_pages(write=not create)

    def _map_pages(self, write: bool) -> None:
        """Fault every page of the ring into this process now, before any message. Measured (2 ranks, 64 KB
        messages, README "Benchmarks"): a sender's first write to a ring page in the middle of a run cost about
        14 us per 4 KB page (0.22 ms to copy 64 KB, against 0.01 ms once mapped), so every send of the first pass
        through the ring (the first ~10 steps of the quick suite) paid it; touching all 16 MB here takes about
        5 ms. The sender writes (its pages become writable); the receiver, which only reads the data, reads one
        byte per page. No message is in flight yet: rings are mapped in ``connect``."""
        if write:
            self.data.zero_()
        else:
            self.data[::mmap.PAGESIZE].sum()

    def copy_in(self, position: int, address: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``address`` (this process's memory) into the ring at ``position``, wrapping at its
        end. A ``memmove`` through ctypes, not tensor slices and ``copy_``: right after a compute the runtime's
        Python and torch's dispatcher are cold in the caches, and a send made of views and a copy measured
        50 - 70 us of CPU per 64 KB message in a 2-rank run, of which 20 us was the copy itself."""
        start = position % self.capacity
        first = min(nbytes, self.capacity - start)
        _memmove(self.base + start, address, first)
        if first < nbytes:
            _memmove(self.base, address + first, nbytes - first)

    def copy_out(self, position: int, address: int, nbytes: int) -> None:
        """Copy ``nbytes`` of the ring at ``position`` to ``address``, wrapping at the ring's end."""
        start = position % self.capacity
        first = min(nbytes, self.capacity - start)
        _memmove(address, self.base + start, first)
        if first < nbytes:
            _memmove(address + first, self.base, nbytes - first)

    def header_at(self, position: int) -> int:
        return (_CONTROL + position % self.capacity) // 8


class Work:
    """What ``isend``/``irecv`` return: ``wait(timeout)`` as gloo's work (False when it timed out)."""

    __slots__ = ("transport", "done")

    def __init__(self, transport):
        self.transport = transport
        self.done = False

    def wait(self, timeout=None) -> bool:
        return self.done or self.transport.wait(self, timeout)


class _Outgoing:
    def __init__(self, ring: Ring):
        self.ring = ring
        self.written = 0
        # [address, bytes, bytes written, header written, tag, work, the tensor (kept alive until copied)]
        self.pending = deque()
        ring.words[_WRITER_PID] = os.getpid()

    def post(self, tensor: torch.Tensor, tag: int, work: Work) -> None:
        self.pending.append([tensor.data_ptr(), tensor.nbytes, 0, False, tag, work, tensor])
        self.flush()

    def flush(self) -> None:
        ring, words = self.ring, self.ring.words
        while self.pending:
            item = self.pending[0]
            address, size, offset = item[0], item[1], item[2]
            free = ring.capacity - (self.written - words[_READ])
            if not item[3]:
                if free < ALIGN:
                    return
                at = ring.header_at(self.written)
                words[at], words[at + 1] = item[4], size
                self.written += ALIGN
                free -= ALIGN
                item[3] = True
            remaining = size - offset
            if remaining > free:  # a piece now, the rest when the receiver has made room
                piece = free
                if piece > 0:
                    ring.copy_in(self.written, address + offset, piece)
                    self.written += piece
                    item[2] = offset + piece
                words[_WRITE] = self.written
                return
            if remaining:
                ring.copy_in(self.written, address + offset, remaining)
            self.written += _round_up(remaining)
            words[_WRITE] = self.written
            self.pending.popleft()
            item[5].done = True


class _Incoming:
    def __init__(self, ring: Ring, me: int, peer: int):
        self.ring = ring
        self.me, self.peer = me, peer
        self.read = 0
        self.current = None  # [tag, target tensor, its address, its bytes, work or None, bytes read]
        self.posted: dict = {}  # tag -> deque of (target tensor, work)
        self.unexpected: dict = {}  # tag -> deque of uint8 tensors (arrived before their receive)
        ring.words[_READER_PID] = os.getpid()

    def post(self, tensor: torch.Tensor, tag: int, work: Work) -> None:
        early = self.unexpected.get(tag)
        if early:
            data = early.popleft()
            self._check_size(tag, data.nbytes, tensor.nbytes)
            _memmove(tensor.data_ptr(), data.data_ptr(), data.nbytes)
            work.done = True
            return
        self.posted.setdefault(tag, deque()).append((tensor, work))
        self.drain()

    def _check_size(self, tag: int, got: int, expected: int) -> None:
        if got != expected:
            raise PipelineError(
                f"rank {self.me} received a message of {got} bytes from rank {self.peer} (tag {tag}) where its "
                f"plan expects {expected} bytes: the two ranks run different plans or batch shapes; run every "
                f"rank from the same output folder and the same batch")

    def drain(self) -> None:
        ring, words = self.ring, self.ring.words
        available = words[_WRITE] - self.read
        while available > 0:
            if self.current is None:
                at = ring.header_at(self.read)
                tag, size = words[at], words[at + 1]
                self.read += ALIGN
                available -= ALIGN
                queue = self.posted.get(tag)
                if queue:
                    target, work = queue.popleft()
                    self._check_size(tag, size, target.nbytes)
                else:
                    target, work = torch.empty(size, dtype=torch.uint8), None
                self.current = [tag, target, target.data_ptr(), size, work, 0]
            tag, target, address, size, work, offset = self.current
            remaining = size - offset
            if remaining > available:  # the rest is still on its way
                if available > 0:
                    ring.copy_out(self.read, address + offset, available)
                    self.current[5] = offset + available
                    self.read += available
                break
            if remaining:
                ring.copy_out(self.read, address + offset, remaining)
            self.read += _round_up(remaining)
            available -= _round_up(remaining)
            self.current = None
            if work is not None:
                work.done = True
                continue
            queue = self.posted.get(tag)  # its receive was posted while it streamed in
            if queue:
                late, late_work = queue.popleft()
                self._check_size(tag, size, late.nbytes)
                _memmove(late.data_ptr(), address, size)
                late_work.done = True
            else:
                self.unexpected.setdefault(tag, deque()).append(target)
        words[_READ] = self.read


class SharedMemoryP2P:
    """``isend``/``irecv`` with gloo's matching (peer, tag, posting order) over :class:`Ring` pairs."""

    def __init__(self, rank: int, outgoing: dict, incoming: dict, own_core: bool = True):
        self.rank = rank
        # a rank with a core of its own polls for 0.2 ms, yields its core until 2 ms, then naps; one that shares
        # its core with other ranks naps after 20 us, so that the peers it waits for get the core
        self.spin_s, self.yield_s = (0.0002, 0.002) if own_core else (0.00002, 0.00002)
        self.outgoing = {peer: _Outgoing(ring) for peer, ring in outgoing.items()}
        self.incoming = {peer: _Incoming(ring, rank, peer) for peer, ring in incoming.items()}

    def carries(self, peer: int, send: bool) -> bool:
        return peer in (self.outgoing if send else self.incoming)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        work = Work(self)
        self.outgoing[peer].post(tensor if tensor.is_contiguous() else tensor.contiguous(), tag, work)
        return work

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        if not tensor.is_contiguous():
            raise ValueError("a receive buffer must be contiguous")
        work = Work(self)
        self.incoming[peer].post(tensor, tag, work)
        return work

    def progress(self) -> None:
        for channel in self.outgoing.values():
            if channel.pending:
                channel.flush()
        for channel in self.incoming.values():
            channel.drain()

    def wait(self, work: Work, timeout=None) -> bool:
        """Move every channel on until ``work`` is done; False after ``timeout`` (a timedelta or seconds)."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        next_check = start + 0.5
        while True:
            self.progress()
            if work.done:
                return True
            now = time.perf_counter()
            if now - start > self.yield_s:
                time.sleep(0.00005)
            elif now - start > self.spin_s:
                os.sched_yield()
            if now >= next_check:
                self._check_peers()
                next_check = now + 0.5
            if deadline is not None and now >= deadline:
                return False

    def _check_peers(self) -> None:
        for peer, channel in self.incoming.items():
            pid = channel.ring.words[_WRITER_PID]
            if pid and not _alive(pid):
                raise PipelineError(f"rank {peer} (process {pid}) exited while rank {self.rank} waited for its "
                                    f"messages: see that rank's error above")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_id() -> str:
    """Processes with the same id share /dev/shm: the host name and this boot's id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def connect(rank: int, send_to: set, receive_from: set, ring_bytes: int, mode: str = "auto", group=None,
            own_core: bool = True):
    """Collective over ``group`` (every rank calls it): rings for each pair of ranks on this host that exchange
    messages (``send_to``/``receive_from``: global ranks). Returns (transport or None, note or None): the
    note says which pairs stay on gloo and why. ``mode``: auto (shared memory where possible), shm (the same,
    but a pair that cannot have it is an error), gloo (no rings)."""
    import torch.distributed as dist

    if mode not in MODES:
        raise ValueError(f"--p2p must be one of {', '.join(MODES)}, not {mode!r}")
    reason = available() if mode != "gloo" else "--p2p gloo"
    if reason is None and mode == "auto" and not own_core:
        # measured (4 ranks on 2 cores, 1F1B, README "Benchmarks"): polling that yields its core made the step
        # 10 - 25% slower than gloo's receive, which sleeps until the data is in; with naps it is on par (140 - 163
        # against 141 - 163 ms over three alternating runs), so gloo stays where there is nothing to gain
        reason = (f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} local ranks share {len(os.sched_getaffinity(0))} "
                  f"cores; shared memory gains nothing measurable without a core per rank (--p2p shm to insist)")
    ring_bytes = _round_up(max(ALIGN, int(ring_bytes)))
    world = dist.get_world_size(group)
    infos = [None] * world
    dist.all_gather_object(infos, {"rank": rank, "host": _host_id(), "reason": reason,
                                   "send_to": sorted(send_to), "receive_from": sorted(receive_from)}, group=group)
    by_rank = {info["rank"]: info for info in infos}
    me = by_rank[rank]

    def shareable(peer: int) -> bool:
        other = by_rank.get(peer)
        return (other is not None and me["reason"] is None and other["reason"] is None
                and other["host"] == me["host"])

    # 1. each receiver makes the files of its incoming rings
    token = uuid.uuid4().hex[:12]
    created, problems = {}, []
    for peer in sorted(receive_from):
        if not shareable(peer):
            continue
        path = os.path.join(_SHM_DIR, f"tracepp-{token}-{peer}to{rank}")
        try:
            created[peer] = Ring(path, ring_bytes, create=True)
        except OSError as error:
            problems.append(f"ring {peer}->{rank} ({ring_bytes / 2**20:g} MB in {_SHM_DIR}): {error}")
    paths = [None] * world
    dist.all_gather_object(paths, (rank, {peer: ring.path for peer, ring in created.items()}), group=group)
    # 2. each sender maps the files made for it
    opened = {}
    for owner, rings in paths:
        path = rings.get(rank)
        if path is None or owner not in send_to:
            continue
        try:
            opened[owner] = Ring(path, ring_bytes, create=False)
        except OSError as error:
            problems.append(f"ring {rank}->{owner}: {error}")
    results = [None] * world
    dist.all_gather_object(results, (rank, sorted(opened), problems), group=group)
    # 3. a ring is used when both ends have it; the files go now (the mappings stay)
    ends = {(sender, receiver) for sender, receivers, _ in results for receiver in receivers}
    for ring in created.values():
        os.unlink(ring.path)
    outgoing = {peer: ring for peer, ring in opened.items() if (rank, peer) in ends}
    incoming = {peer: ring for peer, ring in created.items() if (peer, rank) in ends}
    all_problems = [text for _rank, _opened, found in results for text in found]
    reasons = sorted({info["reason"] for info in infos if info["reason"]})
    wanted = {(info["rank"], peer) for info in infos for peer in info["send_to"]}
    on_gloo = sorted(wanted - ends)
    note = None
    if on_gloo and mode != "gloo":
        why = "; ".join(all_problems + reasons) or "the ranks are on different hosts"
        note = (f"pipeline messages of rank pairs {', '.join(f'{a}->{b}' for a, b in on_gloo)} go through gloo, "
                f"not shared memory: {why}")
        if mode == "shm" and (all_problems or reasons):
            raise PipelineError(f"--p2p shm: {note}; free space in {_SHM_DIR}, lower --shm-ring-mb, "
                                f"or use --p2p auto")
    if not outgoing and not incoming:  # this rank's messages all go through gloo
        return None, note
    return SharedMemoryP2P(rank, outgoing, incoming, own_core), note
