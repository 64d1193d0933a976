"""Training and validation batches read from a file of token ids (``run.py --data`` / ``--eval-data``).

The file is nanoGPT's flat ``.bin`` of uint16 token ids, or a ``.npy`` array of any integer dtype. It is
memory-mapped, never read whole: a step reads only its own windows. A batch has the shape of the model file's
example batch: ``B`` windows of the traced sequence length ``T``; the input of a window at position ``i`` is
``tokens[i:i+T]`` and its target ``tokens[i+1:i+T+1]`` (the same shape as the input; the loss function flattens
it as it does the example target).

Training positions are drawn from ``(seed, step)`` alone (:func:`window_starts`), so every rank builds the same
batch without talking to the others, and a job resumed at step K reads exactly the batches an uninterrupted
job reads from step K on: the data position is the step, which every checkpoint records with the seed and the
file (:func:`data_record`, :func:`check_resumed`). Validation uses ``K`` fixed batches spread evenly over the
held-out file, the same at every evaluation.

The manifest's ``token_input`` says which root input takes the tokens and the vocabulary of the embedding that
reads them (found in the traced graph at split time), so a token id the model cannot embed is reported with
the file and the numbers before the first step.
"""
from __future__ import annotations

import os

import torch

from .failure import PipelineError

_SCAN_CHUNK = 1 << 24  # tokens per slice when checking ids against the vocabulary


def token_input(manifest: dict, flag: str = "--data") -> dict:
    """The manifest's record of the token input ({leaf_index, batch, seq, vocab}), or an error saying why this
    model cannot take token windows."""
    record = manifest.get("token_input")
    if record is None:
        batched = [f"{ref['path']} ({ref['dtype']}, shape {ref['shape']})"
                   for ref in manifest["root_inputs"] if ref.get("batched")]
        raise PipelineError(
            f"{flag} feeds windows of token ids to a model whose one batched input is a (batch, sequence) integer "
            f"tensor; this model's batched inputs are {', '.join(batched) or 'none'}. Keep batch(step) in the model "
            f"file for this model (drop {flag})")
    return record


class TokenFile:
    """A memory-mapped file of token ids: ``len(file)`` tokens, ``file.read(start, count)`` an int64 tensor."""

    def __init__(self, path: str, flag: str = "--data"):
        import numpy as np

        self.path, self.flag = path, flag
        if not os.path.isfile(path):
            raise PipelineError(f"{flag} {path}: no such file (expected a .bin of uint16 token ids, nanoGPT's "
                                f"format, or a .npy array of integer token ids)")
        try:
            if path.endswith(".npy"):
                tokens = np.load(path, mmap_mode="r")
            else:
                tokens = np.memmap(path, dtype=np.uint16, mode="r")
        except (ValueError, OSError) as error:
            raise PipelineError(f"{flag} {path}: cannot be read as token ids ({error}); write a .bin of uint16 "
                                f"or a .npy of integers (see examples/prepare_tokens.py)") from error
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise PipelineError(f"{flag} {path}: holds a {tokens.dtype} array of shape {list(tokens.shape)}; "
                                f"token ids are a 1-D array of integers")
        self.tokens = tokens

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, start: int, count: int) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(np.asarray(self.tokens[start:start + count], dtype=np.int64))

    def windows(self, starts: list, seq: int) -> tuple:
        """The batch ``((inputs,), {}, targets)`` of the windows at ``starts``: inputs ``tokens[i:i+seq]``, targets
        the same shifted by one token."""
        data = torch.stack([self.read(start, seq + 1) for start in starts])
        return (data[:, :-1].contiguous(),), {}, data[:, 1:].contiguous()

    def check(self, seq: int, vocab) -> None:
        """At least one window of ``seq + 1`` tokens, and every id below ``vocab`` (a scan of the mapped file,
        slice by slice)."""
        if len(self) < seq + 1:
            raise PipelineError(f"{self.flag} {self.path}: {len(self)} tokens, shorter than one window of the "
                                f"model's sequence length {seq} plus its target token ({seq + 1}); use a longer "
                                f"file")
        if vocab is None:
            return
        for begin in range(0, len(self), _SCAN_CHUNK):
            part = self.tokens[begin:begin + _SCAN_CHUNK]
            top = int(part.max())
            if top >= vocab:
                where = begin + int((part >= vocab).argmax())
                raise PipelineError(f"{self.flag} {self.path}: token id {top} (first id >= {vocab} at position "
                                    f"{where}) is outside the model's vocabulary of {vocab}: tokenize with the "
                                    f"model's tokenizer, or enlarge the model's embedding")


def window_starts(seed: int, step: int, count: int, limit: int) -> list:
    """``count`` window positions in ``[0, limit)`` drawn from (seed, step) alone: the same on every rank, run
    and restart."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, limit, (count,), generator=generator).tolist()


class TokenBatches:
    """``--data``: step ``s``'s batch ``((inputs,), {}, targets)`` of ``batch`` windows of length ``seq``."""

    def __init__(self, path: str, manifest: dict, seed: int = 0):
        record = token_input(manifest, "--data")
        self.batch, self.seq, self.seed = record["batch"], record["seq"], seed
        self.file = TokenFile(path, "--data")
        self.file.check(self.seq, record.get("vocab"))

    def __call__(self, step: int):
        return self.file.windows(window_starts(self.seed, step, self.batch, len(self.file) - self.seq), self.seq)

    def describe(self) -> str:
        return (f"data: {self.file.path} ({len(self.file):,} tokens), {self.batch} windows of {self.seq} tokens "
                f"per step at positions drawn from --seed {self.seed} and the step")


class EvalBatches:
    """``--eval-data``: ``count`` fixed batches, their windows spread evenly over the file."""

    def __init__(self, path: str, manifest: dict, count: int):
        record = token_input(manifest, "--eval-data")
        self.batch, self.seq, self.count = record["batch"], record["seq"], count
        self.file = TokenFile(path, "--eval-data")
        self.file.check(self.seq, record.get("vocab"))
        windows = count * self.batch
        last = len(self.file) - self.seq - 1
        self.starts = [round(last * k / max(windows - 1, 1)) for k in range(windows)]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        """Batch ``index`` of the ``count``: ``((inputs,), {}, targets)``."""
        if not 0 <= index < self.count:
            raise IndexError(index)
        return self.file.windows(self.starts[index * self.batch:(index + 1) * self.batch], self.seq)

    def __iter__(self):
        return (self[index] for index in range(self.count))


def data_record(source) -> dict:
    """What a checkpoint records of the training data: the file, its length and the seed (the position is the
    checkpoint's step); ``{"source": "batch(step)"}`` for the model file's own batches."""
    if source is None:
        return {"source": "batch(step)"}
    return {"source": "file", "path": os.path.abspath(source.file.path), "tokens": len(source.file),
            "seed": source.seed}


def check_resumed(path: str, saved, current: dict) -> None:
    """A resumed run reads the same stream of batches as the run that saved ``path``, else an error naming
    what differs (a different seed or file would silently train on other batches than an uninterrupted run)."""
    if saved is None or saved == current:
        return
    if saved.get("source") != current.get("source"):
        was = "--data " + saved["path"] if saved.get("source") == "file" else "the model file's batch(step)"
        now = "--data " + current["path"] if current.get("source") == "file" else "the model file's batch(step)"
        raise PipelineError(f"checkpoint {path} was trained on {was}; this run reads {now}: resume with the same "
                            f"data, or start a new --checkpoint-dir")
    if saved.get("seed") != current.get("seed") or saved.get("tokens") != current.get("tokens"):
        raise PipelineError(
            f"checkpoint {path} was trained on {saved['path']} ({saved['tokens']:,} tokens) with --seed "
            f"{saved['seed']}; this run reads {current['path']} ({current['tokens']:,} tokens) with --seed "
            f"{current['seed']}: the batches after the resume would not be those of the saved run. Use the same "
            f"file and --seed, or start a new --checkpoint-dir")
