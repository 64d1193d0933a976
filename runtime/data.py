"""Training and validation batches read from token shards (``run.py --data`` / ``--eval-data``).

What the flags name and how the files are read is :mod:`corpus`'s job (a file, a folder, a glob, a weighted
mixture; nanoGPT's, llm.c's and ``.npy`` formats; memory maps opened on use); which window a step reads is
:mod:`data_order`'s (pure functions). This module puts them together. A batch has the shape of the model file's
example batch: ``B`` windows of the traced sequence length ``T``; the input of a window at position ``i`` is
``tokens[i:i+T]`` and its target ``tokens[i+1:i+T+1]``. A window never crosses from one shard into the next.

``--data-order random`` (the default) draws each step's positions with replacement from (seed, step), as
nanoGPT does; ``epoch`` reads every non-overlapping window of every shard once per pass (window ``k`` of a shard
starts at token ``k * T``), in an order shuffled per pass from the seed. A mixture gives each sample of the run
(``step * B + slot``) to a source by the weights (:class:`data_order.Blend`), and each source runs its own
passes. The position is therefore a function of the seed, the step and the data's identity (:class:`Stream`,
built from the record a checkpoint keeps): every rank builds the same batch without talking to the others, and a
job resumed at step K reads exactly the batches an uninterrupted job reads from step K on. A checkpoint records
every shard's name under its source's folder, token count, size and fingerprint (:func:`data_record`); a resume
on changed data is refused with the change named, or accepted with ``--accept-data-change``: then every source
starts a new pass over the data as it is at that step (:func:`check_resumed`).

Validation uses ``K`` fixed batches spread evenly over all the held-out shards (by their share of the tokens,
and over a mixture's sources by its weights), the same at every evaluation.

The manifest's ``token_input`` says which root input takes the tokens and the vocabulary of the embedding that
reads them (found in the traced graph at split time). Ids are checked against it at open on a bounded sample
(:data:`corpus.SCAN_TOKENS` tokens, the first of every file) and in every window read, so an id the model cannot
embed stops the job with the file, the position and the step, never reaching the embedding.
"""
from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import torch

from .corpus import Maps, TokenFile, check_ids, open_sources  # noqa: F401  (TokenFile: one file, for callers)
from .data_order import Blend, Permutation, key, window_starts  # noqa: F401
from .failure import PipelineError

ORDERS = ("random", "epoch")


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


def _windows(places: list, seq: int, vocab, flag: str, when: str = "") -> tuple:
    """The batch ``((inputs,), {}, targets)`` of the windows at ``places`` ((file, start) pairs): inputs
    ``tokens[i:i+seq]``, targets the same shifted by one token; every id checked against ``vocab``."""
    data = np.empty((len(places), seq + 1), dtype=np.int64)
    for row, (file, start) in enumerate(places):
        data[row] = file.read(start, seq + 1)
        check_ids(data[row], vocab, flag, file.path, start, when)
    # numpy's copies: torch's strided copy of the same took milliseconds on a loaded 2-core machine
    return ((torch.from_numpy(np.ascontiguousarray(data[:, :-1])),), {},
            torch.from_numpy(np.ascontiguousarray(data[:, 1:])))


def _weights(record: dict) -> list:
    return [Fraction(source["weight"]) if source.get("weight") else Fraction(1) for source in record["sources"]]


class Stream:
    """Which window each step reads, from a data record alone (:func:`data_record`): ``picks(step)`` gives the
    step's ``batch`` (source, index) pairs (an index of the source's start positions in random order, of its
    non-overlapping windows in epoch order); ``consumed(step)`` the samples each source gave after ``step``."""

    def __init__(self, record: dict):
        self.order, self.seed = record["order"], record["seed"]
        self.batch, self.seq = record["batch"], record["seq"]
        self.labels = [source["label"] for source in record["sources"]]
        tokens = [[shard[1] for shard in source["shards"]] for source in record["sources"]]
        self.starts = [sum(max(n - self.seq, 0) for n in shards) for shards in tokens]
        self.windows = [sum(max((n - 1) // self.seq, 0) for n in shards) for shards in tokens]
        self.blend = Blend(_weights(record))
        restart = record.get("restart") or {}
        self.base = restart.get("step", 0)
        self.offsets = [restart.get("passes", {}).get(label, 0) for label in self.labels]
        self._permutations = {}

    def _sample(self, step: int, slot: int) -> int:
        if step < self.base:
            raise ValueError(f"step {step} comes before the data change accepted at step {self.base}")
        return (step - self.base) * self.batch + slot

    def picks(self, step: int) -> list:
        if self.order == "random":
            if len(self.labels) == 1:  # nanoGPT's sampler over every start position of every shard
                return [(0, start) for start in window_starts(self.seed, step, self.batch, self.starts[0])]
            draws = window_starts(self.seed, step, self.batch, 1 << 62)
            return [(source, draw % self.starts[source])
                    for draw, (source, _index) in zip(draws, (self.blend.pick(self._sample(step, slot))
                                                              for slot in range(self.batch)))]
        groups = {}  # (source, pass) -> [(slot, index within the pass)]: one permutation call per group
        for slot in range(self.batch):
            source, index = self.blend.pick(self._sample(step, slot))
            n = self.windows[source]
            groups.setdefault((source, self.offsets[source] + index // n), []).append((slot, index % n))
        out = [None] * self.batch
        for (source, round_), members in groups.items():
            windows = self._permutation(source, round_)([index for _slot, index in members]).tolist()
            for (slot, _index), window in zip(members, windows):
                out[slot] = (source, window)
        return out

    def _permutation(self, source: int, round_: int) -> Permutation:
        found = self._permutations.get((source, round_))
        if found is None:
            if len(self._permutations) > 4 * len(self.labels):
                self._permutations.clear()
            found = self._permutations[(source, round_)] = Permutation(self.windows[source],
                                                                        key(self.seed, source, round_))
        return found

    def consumed(self, step: int) -> list:
        """Samples each source gave from the base (0, or the step of an accepted change) to the end of ``step``."""
        return self.blend.counts(self._sample(step + 1, 0))

    def passes(self, step: int) -> list:
        """Each source's passes after ``step``: the pass number plus the share of the pass done (in random order,
        the windows drawn over the windows of a pass: the same measure of how much has been read)."""
        return [offset + count / windows for offset, count, windows
                in zip(self.offsets, self.consumed(step), self.windows)]

    def begun(self, step: int) -> dict:
        """Per source label, the passes begun after ``step`` (a pass in progress counts whole)."""
        return {label: offset + -(-count // windows) for label, offset, count, windows
                in zip(self.labels, self.offsets, self.consumed(step), self.windows)}


class TokenBatches:
    """``--data``: step ``s``'s batch ``((inputs,), {}, targets)`` of ``batch`` windows of length ``seq``."""

    def __init__(self, path, manifest: dict, seed: int = 0, order: str = "random"):
        if order not in ORDERS:
            raise PipelineError(f"--data-order {order}: use one of {', '.join(ORDERS)}")
        record = token_input(manifest, "--data")
        self.batch, self.seq, self.seed, self.order = record["batch"], record["seq"], seed, order
        self.vocab = record.get("vocab")
        self.sources = open_sources(path, "--data", self.seq, self.vocab, Maps())
        self.follow(self._identity())

    def _identity(self) -> dict:
        return {"source": "tokens", "order": self.order, "seed": self.seed, "batch": self.batch, "seq": self.seq,
                "sources": [{"label": source.label, "weight": str(source.weight) if source.weight else None,
                             "root": source.root,
                             "shards": [[name, len(file), file.bytes, file.fingerprint]
                                        for name, file in zip(source.names, source.files)]}
                            for source in self.sources]}

    def follow(self, record: dict) -> None:
        """Read the stream ``record`` describes: this data's, with the restart of an accepted change, if any
        (what :func:`check_resumed` returns on a resume)."""
        self.record = record
        self.stream = Stream(record)

    def __call__(self, step: int):
        places = []
        for source, index in self.stream.picks(step):
            found = self.sources[source]
            places.append(found.at_start(index) if self.order == "random" else found.at_window(index))
        return _windows(places, self.seq, self.vocab, "--data", f", read for step {step + 1}")

    def position(self, step: int) -> dict:
        """What ``--metrics`` records after ``step``: tokens seen since step 0 and the pass of each source."""
        passes = [round(value, 6) for value in self.stream.passes(step)]
        return {"tokens_seen": (step + 1) * self.batch * self.seq,
                "data_pass": passes[0] if len(passes) == 1 else dict(zip(self.stream.labels, passes))}

    def scalars(self, step: int) -> dict:
        """The same as TensorBoard scalars."""
        passes = self.stream.passes(step)
        out = {"data/tokens_seen": (step + 1) * self.batch * self.seq}
        if len(passes) == 1:
            out["data/pass"] = passes[0]
        else:
            out.update({f"data/pass/{label}": value for label, value in zip(self.stream.labels, passes)})
        return out

    def describe(self) -> str:
        if self.order == "random":
            how = f"at positions drawn from --seed {self.seed} and the step"
        else:
            how = f"every non-overlapping window once per pass, shuffled per pass from --seed {self.seed}"
        parts = []
        total = float(sum(self.stream.blend.counts(1 << 40)))
        for source, windows, taken in zip(self.sources, self.stream.windows, self.stream.blend.counts(1 << 40)):
            what = (source.files[0].path if len(source.files) == 1
                    else f"{source.spec}: {len(source.files):,} files")
            share = f"{taken / total:.0%} " if len(self.sources) > 1 else ""
            steps = windows * total / taken / self.batch
            parts.append(f"{share}{what} ({source.formats()}, {source.tokens:,} tokens, a pass every "
                         f"{steps:,.0f} steps)")
        return (f"data: {'; '.join(parts)}; {self.batch} windows of {self.seq} tokens per step {how}"
                + ("" if self.stream.base == 0 else f" (every source began a new pass at step "
                                                    f"{self.stream.base + 1}, after a data change)"))


class EvalBatches:
    """``--eval-data``: ``count`` fixed batches, their windows spread evenly over all the shards."""

    def __init__(self, path, manifest: dict, count: int):
        record = token_input(manifest, "--eval-data")
        self.batch, self.seq, self.count = record["batch"], record["seq"], count
        self.vocab = record.get("vocab")
        self.sources = open_sources(path, "--eval-data", self.seq, self.vocab, Maps())
        blend = Blend([source.weight or 1 for source in self.sources])
        windows = count * self.batch
        per_source = blend.counts(windows)
        self.places = []
        for g in range(windows):
            index, m = blend.pick(g)
            source = self.sources[index]
            self.places.append(source.at_start(round((source.starts - 1) * m / max(per_source[index] - 1, 1))))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        """Batch ``index`` of the ``count``: ``((inputs,), {}, targets)``."""
        if not 0 <= index < self.count:
            raise IndexError(index)
        return _windows(self.places[index * self.batch:(index + 1) * self.batch], self.seq, self.vocab,
                        "--eval-data")

    def __iter__(self):
        return (self[index] for index in range(self.count))


def data_record(source) -> dict:
    """What a checkpoint records of the training data, enough to rebuild the stream's position at any step
    (:class:`Stream`): order, seed, batch and window, and per source its weight, folder and shards (name, tokens,
    bytes, fingerprint); ``{"source": "batch(step)"}`` for the model file's own batches."""
    if source is None:
        return {"source": "batch(step)"}
    return source.record


def _upgrade(saved: dict, current: dict) -> dict:
    """A record written before shards ({source: file, path, tokens, seed}) in today's form: nanoGPT's sampler on
    one file, matched to a current single file by its token count (as it was then)."""
    if saved.get("source") != "file":
        return saved
    name = os.path.basename(saved["path"])
    if current.get("source") == "tokens" and len(current["sources"]) == 1 and len(current["sources"][0]["shards"]) == 1:
        name = current["sources"][0]["shards"][0][0]
    label = current["sources"][0]["label"] if current.get("source") == "tokens" else "data"
    return {"source": "tokens", "order": "random", "seed": saved["seed"], "batch": current.get("batch"),
            "seq": current.get("seq"), "sources": [{"label": label, "weight": None,
                                                    "root": os.path.dirname(saved["path"]),
                                                    "shards": [[name, saved["tokens"], None, None]]}]}


def _describe(record: dict) -> str:
    if record.get("source") != "tokens":
        return "the model file's batch(step)"
    shards = [(source["root"], shard) for source in record["sources"] for shard in source["shards"]]
    tokens = sum(shard[1] for _root, shard in shards)
    if len(shards) == 1:
        what = os.path.join(shards[0][0], shards[0][1][0])
    else:
        what = f"{len(shards):,} shards in {len(record['sources'])} source(s)"
    return f"--data {what} ({tokens:,} tokens, {record['order']} order)"


def _names(root: str, names: list) -> str:
    shown = ", ".join(os.path.join(root, name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _changes(saved: dict, current: dict) -> list:
    """What differs between two records' data, in words (empty: the same data)."""
    before, after = saved["sources"], current["sources"]
    if len(before) != len(after):
        def listed(sources, weights):
            return ", ".join(f"{s['label']} {float(w / sum(weights)):.3g}" for s, w in zip(sources, weights))
        return [f"the sources were {listed(before, _weights(saved))}, now {listed(after, _weights(current))}"]
    out = []
    for old, new, old_weight, new_weight in zip(before, after, _weights(saved), _weights(current)):
        label = new["label"]
        if old_weight / sum(_weights(saved)) != new_weight / sum(_weights(current)):
            out.append(f"{label}'s weight was {float(old_weight / sum(_weights(saved))):.3g}, now "
                       f"{float(new_weight / sum(_weights(current))):.3g}")
        was = {shard[0]: shard[1:] for shard in old["shards"]}
        now = {shard[0]: shard[1:] for shard in new["shards"]}
        added = [name for name in now if name not in was]
        removed = [name for name in was if name not in now]
        rewritten = []
        for name in now:
            if name in was:
                (tokens, size, mark), (tokens_now, size_now, mark_now) = was[name], now[name]
                if tokens != tokens_now:
                    rewritten.append(f"{os.path.join(new['root'], name)} ({tokens:,} -> {tokens_now:,} tokens)")
                elif None not in (size, size_now, mark, mark_now) and (size, mark) != (size_now, mark_now):
                    rewritten.append(f"{os.path.join(new['root'], name)} (same tokens count, other contents)")
        if added:
            out.append(f"{label}: {len(added)} shard(s) added ({_names(new['root'], added)})")
        if removed:
            out.append(f"{label}: {len(removed)} shard(s) removed ({_names(old['root'], removed)})")
        if rewritten:
            more = f" and {len(rewritten) - 3} more" if len(rewritten) > 3 else ""
            out.append(f"{label}: {len(rewritten)} shard(s) rewritten ({', '.join(rewritten[:3])}{more})")
    return out


def check_resumed(path: str, saved, current: dict, step: int = 0, accept: bool = False) -> dict:
    """The record a run resumed from checkpoint ``path`` (at ``step``) continues with: ``current`` when the
    checkpoint's data is this run's, else an error naming what differs (a different seed, order or data would
    silently train on other batches than an uninterrupted run). With ``accept`` a change of the data is taken:
    the returned record restarts every source's pass at ``step`` over the data as it is now."""
    if saved is None or saved == current:
        return current
    saved = _upgrade(saved, current)
    if saved.get("source") != current.get("source"):
        raise PipelineError(f"checkpoint {path} was trained on {_describe(saved)}; this run reads "
                            f"{_describe(current)}: resume with the same data, or start a new --checkpoint-dir")
    if current.get("source") != "tokens":
        return current
    if saved["seed"] != current["seed"] or saved["order"] != current["order"]:
        raise PipelineError(
            f"checkpoint {path} was trained on {_describe(saved)} with --seed {saved['seed']}; this run reads "
            f"{_describe(current)} with --seed {current['seed']}: the batches after the resume would not be those "
            f"of the saved run. Use the same --seed and --data-order, or start a new --checkpoint-dir")
    changes = _changes(saved, current)
    if not changes:
        return dict(current, restart=saved["restart"]) if saved.get("restart") else current
    if not accept:
        raise PipelineError(
            f"checkpoint {path} was trained on data that has changed since: {'; '.join(changes)}. The batches after "
            f"the resume would not be those of the saved run: restore the data, or pass --accept-data-change to "
            f"train on the data as it is now from step {step + 1} on (every source starts a new pass there), or "
            f"start a new --checkpoint-dir")
    begun = Stream(saved).begun(step - 1)  # the passes the saved run had begun: the next ones start here
    passes = {source["label"]: begun.get(source["label"], 0) for source in current["sources"]}
    return dict(current, restart={"step": step, "passes": passes, "change": "; ".join(changes)})


def accepted_note(record: dict, step: int):
    """The line a run prints when it has just accepted a change of its data at ``step`` (None otherwise)."""
    restart = (record or {}).get("restart")
    if not restart or restart["step"] != step:
        return None
    return (f"--accept-data-change: {restart['change']}; from step {step + 1} every source of --data starts a new "
            f"pass over the data as it is now")
