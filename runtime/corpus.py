"""Token shards on disk: the files behind ``run.py --data`` / ``--eval-data``, their formats, and what names them.

A value of ``--data`` is a file, a folder (its ``.bin`` and ``.npy`` files), a glob, several of these (a shell
that expanded a glob), or a weighted list of them, one source per weight: ``0.7:web/*.bin,0.3:code/`` or
Megatron's ``0.7 web/ 0.3 code/`` (:func:`parse_sources`). Each file's format is recognised by its first bytes
(:class:`TokenFile`):

- llm.c's shards (FineWeb as llm.c and modded-nanoGPT write it): a header of 256 int32 (magic, version, token
  count), then the tokens: magic 20240520 version 1 for uint16, 20240801 version 7 for uint32 (Llama 3);
- a ``.npy`` array: a 1-D array of any integer dtype;
- anything else: nanoGPT's headerless uint16.

Opening reads a few kilobytes of each file and no more: its header and size, a fingerprint (the first 4 KiB and
four 256-byte samples, hashed: a shard rewritten since a checkpoint is noticed without reading it whole) and a
bounded sample for the vocabulary check (:data:`SCAN_TOKENS` tokens in all, spread over the files; every window
read later is checked too). Windows are read through memory maps opened on first use (:class:`Maps`), as many
at once as a quarter of the process's file descriptor limit allows (each holds one; 256 under the common soft
limit of 1024), and a read's pages are unmapped after the copy, so a long job's resident memory does not grow
with the data it has read.
"""
from __future__ import annotations

import bisect
import glob
import hashlib
import mmap
import os
import re
import struct
from collections import OrderedDict
from fractions import Fraction

import numpy as np

from .failure import PipelineError

HEADER_BYTES = 1024  # llm.c: 256 int32
LLMC = {20240520: (1, np.dtype("<u2"), "llm.c uint16"), 20240801: (7, np.dtype("<u4"), "llm.c uint32")}
EXTENSIONS = (".bin", ".npy")
SCAN_TOKENS = 1 << 22  # tokens checked against the vocabulary at open, spread over the files
_FORMATS = ("nanoGPT's headerless uint16 .bin, llm.c's .bin (256 int32 of header, then uint16 or uint32 "
            "tokens), or a 1-D .npy of integers")
_FIX = "write it again (examples/prepare_tokens.py, or llm.c's dev/data scripts)"


class TokenFile:
    """One file of token ids (a shard): ``len(file)`` tokens, ``file.read(start, count)`` an int64 array.

    Attributes: ``path``, ``format`` (``nanoGPT uint16``, ``llm.c uint16``, ``llm.c uint32``, ``.npy int32``...),
    ``dtype``, ``offset`` (bytes before the first token), ``bytes`` (the file's size), ``fingerprint``."""

    def __init__(self, path: str, flag: str = "--data", maps=None):
        self.path, self.flag = path, flag
        self.maps = maps if maps is not None else Maps()
        if not os.path.isfile(path):
            raise PipelineError(f"{flag} {path}: no such file (expected {_FORMATS})")
        try:
            with open(path, "rb") as handle:
                self.bytes = os.fstat(handle.fileno()).st_size
                head = handle.read(4096)
                if path.endswith(".npy"):
                    self._npy(handle)
                else:
                    self._bin(head)
                self.fingerprint = _fingerprint(handle.fileno(), self.bytes, head)
        except OSError as error:
            raise PipelineError(f"{flag} {path}: cannot be read ({error})") from error

    def _npy(self, handle) -> None:
        handle.seek(0)
        try:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
            else:
                shape, fortran, dtype = np.lib.format._read_array_header(handle, version)
        except (ValueError, OSError, SyntaxError) as error:
            raise PipelineError(f"{self.flag} {self.path}: not a readable .npy file ({error}); {_FIX}") from error
        if len(shape) != 1 or dtype.kind not in "iu":
            raise PipelineError(f"{self.flag} {self.path}: holds a {dtype} array of shape {list(shape)}; token ids "
                                f"are a 1-D array of integers")
        self.dtype, self.offset, self.count = dtype, handle.tell(), int(shape[0])
        self.format = f".npy {dtype.name}"
        expected = self.offset + self.count * dtype.itemsize
        if self.bytes < expected:
            raise PipelineError(f"{self.flag} {self.path}: its .npy header says {self.count:,} tokens ({expected:,} "
                                f"bytes with the header) but the file has {self.bytes:,} bytes: it is truncated "
                                f"or still being written; {_FIX}")

    def _bin(self, head: bytes) -> None:
        magic = struct.unpack("<i", head[:4])[0] if len(head) >= 4 else None
        if magic in LLMC:
            version, dtype, name = LLMC[magic]
            if len(head) < HEADER_BYTES:
                raise PipelineError(f"{self.flag} {self.path}: starts with llm.c's magic {magic} but has only "
                                    f"{self.bytes:,} bytes, less than llm.c's {HEADER_BYTES}-byte header; {_FIX}")
            found, count = struct.unpack("<ii", head[4:12])
            if found != version:
                raise PipelineError(f"{self.flag} {self.path}: llm.c header with magic {magic} and version {found}; "
                                    f"tracepp reads version {version} for magic {magic} ({name}); {_FIX}")
            expected = HEADER_BYTES + max(count, 0) * dtype.itemsize
            if count < 0 or expected != self.bytes:
                raise PipelineError(f"{self.flag} {self.path}: llm.c's header says {count:,} tokens ({expected:,} "
                                    f"bytes with the header) but the file has {self.bytes:,} bytes: it is "
                                    f"truncated, still being written, or not llm.c's format; {_FIX}")
            self.dtype, self.offset, self.count, self.format = dtype, HEADER_BYTES, count, name
            return
        if self.bytes % 2:
            raise PipelineError(f"{self.flag} {self.path}: {self.bytes:,} bytes is not a whole number of uint16 "
                                f"tokens (nanoGPT's headerless .bin; no llm.c header found); expected {_FORMATS}")
        self.dtype, self.offset, self.count, self.format = np.dtype("<u2"), 0, self.bytes // 2, "nanoGPT uint16"

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``start .. start+count`` as int64, through a memory map (never the whole file)."""
        return self.maps.read(self, start, count)

    def scan(self, count: int, vocab: int) -> None:
        """The first ``count`` tokens are ids in ``[0, vocab)``, else an error naming the file, the id and its
        position (read with plain reads, a slice at a time: nothing stays mapped)."""
        count = min(count, self.count)
        step = 1 << 20
        with open(self.path, "rb") as handle:
            for begin in range(0, count, step):
                size = min(step, count - begin) * self.dtype.itemsize
                part = np.frombuffer(os.pread(handle.fileno(), size, self.offset + begin * self.dtype.itemsize),
                                     dtype=self.dtype)
                check_ids(part, vocab, self.flag, self.path, begin)


def check_ids(tokens: np.ndarray, vocab, flag: str, path: str, first: int, when: str = "") -> None:
    """Every id of ``tokens`` (read at token ``first`` of ``path``) is in ``[0, vocab)``."""
    if vocab is None or not tokens.size:
        return
    top, low = int(tokens.max()), int(tokens.min())
    if top >= vocab:
        where = first + int((tokens >= vocab).argmax())
        raise PipelineError(f"{flag} {path}: token id {top} (first id >= {vocab} at position {where}{when}) is "
                            f"outside the model's vocabulary of {vocab}: tokenize with the model's tokenizer, or "
                            f"enlarge the model's embedding")
    if low < 0:
        where = first + int((tokens < 0).argmax())
        raise PipelineError(f"{flag} {path}: token id {low} at position {where}{when} is negative: token ids are "
                            f"0 .. {vocab - 1}")


def _fingerprint(fd: int, size: int, head: bytes) -> str:
    """A hash of the size, the first 4 KiB and 256 bytes at a quarter, half, three quarters and the end: a shard
    rewritten with other tokens is noticed without reading it whole."""
    digest = hashlib.blake2b(struct.pack("<q", size) + head, digest_size=8)
    for at in (size // 4, size // 2, 3 * size // 4, max(size - 256, 0)):
        digest.update(os.pread(fd, 256, at))
    return digest.hexdigest()


class Maps:
    """Memory maps of token files, opened on first read, at most ``limit`` at once (least recently used closed
    first; each holds a file descriptor). The maps are advised random access (no read-ahead: a window is a few
    KiB), and the pages a read touched (with the kernel's fault-around, up to 64 KiB about them) are unmapped again
    after the copy: a mapped page counts in the process's resident memory, so without it a long job's would grow
    with the data it has read (the page cache keeps them either way)."""

    def __init__(self, limit=None):
        self.limit = limit or _map_limit()
        self.open = OrderedDict()

    def read(self, file: TokenFile, start: int, count: int) -> np.ndarray:
        if start < 0 or start + count > file.count:
            raise IndexError(f"{file.path}: tokens {start}..{start + count} of {file.count}")
        found = self.open.pop(file.path, None)
        if found is None:
            if len(self.open) >= self.limit:
                self.open.popitem(last=False)
            found = self._map(file)
        self.open[file.path] = found
        mapped, tokens = found
        data = np.array(tokens[start:start + count], dtype=np.int64)
        if _DONTNEED is not None:
            first = (file.offset + start * file.dtype.itemsize) & ~(_AROUND - 1)
            last = min(file.offset + (start + count) * file.dtype.itemsize + _AROUND, len(mapped))
            mapped.madvise(_DONTNEED, first, last - first)
        return data

    def _map(self, file: TokenFile) -> tuple:
        for attempt in range(2):
            try:
                with open(file.path, "rb") as handle:
                    mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                break
            except (OSError, ValueError) as error:  # out of address space (ulimit -v) or file descriptors
                if attempt or not self.open:
                    raise PipelineError(f"{file.flag} {file.path}: cannot be memory-mapped ({error})") from error
                self.open.clear()
        if hasattr(mmap, "MADV_RANDOM"):
            mapped.madvise(mmap.MADV_RANDOM)
        return mapped, np.frombuffer(mapped, dtype=file.dtype, count=file.count, offset=file.offset)


_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_AROUND = 1 << 16  # Linux maps up to 64 KiB of cached pages about a faulting one (fault_around_bytes)


def _map_limit() -> int:
    """How many files stay mapped at once: a quarter of the file descriptors this process may open (each map
    holds one), between 16 and 4096."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 16
    except (ImportError, OSError, ValueError):  # no resource module (Windows): a common default
        soft = 1024
    return max(16, min(4096, soft // 4))


# --- what --data names --------------------------------------------------------------------------------------

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_WEIGHTED = re.compile(r"^\s*([^:]*?)\s*:(.+)$")


def _weight(text: str, flag: str, item: str) -> Fraction:
    text = text.strip()
    if not _NUMBER.match(text) or Fraction(text) <= 0:
        raise PipelineError(f"{flag} {item}: the weight {text!r} is not a positive number; a weighted source is "
                            f"WEIGHT:PATH, e.g. 0.7:web/*.bin,0.3:code/ (or Megatron's form: 0.7 web/ 0.3 code/)")
    return Fraction(text)


def parse_sources(values, flag: str = "--data") -> list:
    """``[(weight or None, [pattern, ...], label), ...]``: one source per weight (one unweighted source without
    weights). ``values``: a string, or the list argparse gives (``nargs='+'``)."""
    values = [values] if isinstance(values, str) else list(values)
    items = []
    for value in values:  # a comma separates items, unless the whole value names a file
        items += [value] if os.path.exists(value) else [part for part in value.split(",") if part.strip()]
    if not items:
        raise PipelineError(f"{flag}: no path given; pass a file, a folder, a glob or a weighted list")
    weighted = [None if os.path.exists(item) else _WEIGHTED.match(item) for item in items]
    if all(weighted):
        pairs = [(_weight(match.group(1), flag, item), match.group(2).strip()) for match, item in zip(weighted, items)]
    elif len(items) >= 2 and len(items) % 2 == 0 and all(_NUMBER.match(item) and not os.path.exists(item)
                                                         for item in items[0::2]):
        pairs = [(_weight(w, flag, f"{w} {p}"), p) for w, p in zip(items[0::2], items[1::2])]
    elif any(weighted):
        bad = next(item for item, match in zip(items, weighted) if match)
        raise PipelineError(f"{flag} {','.join(items)}: {bad!r} has a weight and other items do not; give every "
                            f"source a weight (0.7:web/*.bin,0.3:code/) or none (one source of all the files)")
    else:
        return [(None, items, _label(items[0]))]
    labels = []
    for _unused, pattern in pairs:
        label = _label(pattern)
        labels.append(label if label not in labels else f"{label}_{len(labels)}")
    return [(weight, [pattern], label) for (weight, pattern), label in zip(pairs, labels)]


def _label(pattern: str) -> str:
    """A short name for a source: web/*.bin -> web, code/ -> code, data/fineweb_train_*.bin -> fineweb_train."""
    pattern = pattern.rstrip("/" + os.sep) or pattern
    base = os.path.basename(pattern)
    if glob.has_magic(base):
        base = re.split(r"[*?\[]", base)[0].rstrip("_-.") or os.path.basename(os.path.dirname(pattern))
    for extension in EXTENSIONS:
        if base.endswith(extension):
            base = base[:-len(extension)]
    return base or "data"


_TRAIN = re.compile(r"(^|[_\-.])train([_\-.]|$)")
_VAL = re.compile(r"(^|[_\-.])(val|valid|validation|test)([_\-.]|$)")


def expand(pattern: str, flag: str = "--data") -> list:
    """The files a pattern names, sorted: a file; a folder's ``.bin``/``.npy`` files; a glob's matches."""
    if os.path.isdir(pattern):
        names = sorted(name for name in os.listdir(pattern)
                       if name.endswith(EXTENSIONS) and not name.startswith(".")
                       and os.path.isfile(os.path.join(pattern, name)))
        if not names:
            raise PipelineError(f"{flag} {pattern}: the folder holds no .bin or .npy token file; pass the folder "
                                f"of the shards, or the files themselves")
        train = [name for name in names if _TRAIN.search(name)]
        held_out = [name for name in names if _VAL.search(name)]
        if train and held_out:
            glob_hint = os.path.join(pattern, re.sub(r"\d+", "*", train[0]))
            raise PipelineError(f"{flag} {pattern}: the folder holds training and held-out shards ({train[0]}, "
                                f"{held_out[0]}): pass a glob of the ones you mean, e.g. '{glob_hint}'")
        return [os.path.join(pattern, name) for name in names]
    if glob.has_magic(pattern):
        found = sorted(path for path in glob.glob(pattern) if os.path.isfile(path))
        if not found:
            raise PipelineError(f"{flag} {pattern}: the glob matches no file (looked from {os.getcwd()}); check "
                                f"the folder and the pattern")
        return found
    if not os.path.exists(pattern):
        raise PipelineError(f"{flag} {pattern}: no such file or folder (expected {_FORMATS}, a folder of them, a "
                            f"glob, or a weighted list such as 0.7:web/*.bin,0.3:code/)")
    return [pattern]


class Source:
    """The shards of one source (one weight of a mixture): ``files`` sorted by path, ``names`` relative to
    ``root`` (what a checkpoint matches them by, so the data may move), and two ways to number its windows:
    every start position (``starts``, random order) and the non-overlapping windows (``windows``, epoch order)."""

    def __init__(self, weight, patterns: list, label: str, flag: str, seq: int, maps: Maps):
        paths = sorted({path for pattern in patterns for path in expand(pattern, flag)})
        self.weight, self.label, self.flag, self.seq, self.spec = weight, label, flag, seq, ",".join(patterns)
        self.files = [TokenFile(path, flag, maps) for path in paths]
        absolute = [os.path.abspath(path) for path in paths]
        self.root = os.path.commonpath([os.path.dirname(path) for path in absolute])
        self.names = [os.path.relpath(path, self.root) for path in absolute]
        self.start_counts = [max(len(file) - seq, 0) for file in self.files]
        self.window_counts = [max((len(file) - 1) // seq, 0) for file in self.files]
        self._starts = _cumulative(self.start_counts)
        self._windows = _cumulative(self.window_counts)
        if not self.windows:
            if len(self.files) == 1:
                raise PipelineError(f"{flag} {paths[0]}: {len(self.files[0])} tokens, shorter than one window of "
                                    f"the model's sequence length {seq} plus its target token ({seq + 1}); use a "
                                    f"longer file")
            raise PipelineError(f"{flag} {self.spec}: {len(self.files)} files of {self.tokens:,} tokens, none "
                                f"holding one window of the model's sequence length {seq} plus its target token "
                                f"({seq + 1}); use longer shards")

    @property
    def tokens(self) -> int:
        return sum(len(file) for file in self.files)

    @property
    def starts(self) -> int:
        return self._starts[-1]

    @property
    def windows(self) -> int:
        return self._windows[-1]

    def at_start(self, index: int) -> tuple:
        """Start position ``index`` of all of them (random order) -> (file, token offset)."""
        shard = bisect.bisect_right(self._starts, index) - 1
        return self.files[shard], index - self._starts[shard]

    def at_window(self, index: int) -> tuple:
        """Non-overlapping window ``index`` (epoch order) -> (file, token offset)."""
        shard = bisect.bisect_right(self._windows, index) - 1
        return self.files[shard], (index - self._windows[shard]) * self.seq

    def formats(self) -> str:
        found = sorted({file.format for file in self.files})
        return ", ".join(found)


def _cumulative(counts: list) -> list:
    total, out = 0, [0]
    for count in counts:
        total += count
        out.append(total)
    return out


def open_sources(values, flag: str, seq: int, vocab, maps: Maps) -> list:
    """The sources ``values`` names, each file's header and size checked and a bounded sample of its ids checked
    against ``vocab`` (:data:`SCAN_TOKENS` in all, the first tokens of every file)."""
    sources = [Source(weight, patterns, label, flag, seq, maps)
               for weight, patterns, label in parse_sources(values, flag)]
    if vocab is not None:
        files = [file for source in sources for file in source.files]
        share = max(SCAN_TOKENS // len(files), seq + 1)
        for file in files:
            file.scan(share, vocab)
    return sources
