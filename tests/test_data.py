"""Tier 1: the data of a long job as plain data, in one process: shard formats and their errors, what --data
names (files, folders, globs, weighted mixtures), the epoch order (every window once per pass, reshuffled per
pass), mixtures by their weights, the position as a function of seed, step and data, the resume record and a
changed shard, validation batches over shards, the vocabulary check, and 1,000 sparse 100M-token shards opened
in bounded memory."""
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from tracepp.runtime import corpus
from tracepp.runtime.corpus import Maps, TokenFile, parse_sources
from tracepp.runtime.data import (EvalBatches, Stream, TokenBatches, accepted_note, check_resumed, data_record)
from tracepp.runtime.data_order import Blend, Permutation, key
from tracepp.runtime.failure import PipelineError
from util import REPO


def manifest(batch=4, seq=5, vocab=1 << 20):
    return {"token_input": {"leaf_index": 0, "path": "args[0]", "batch": batch, "seq": seq, "vocab": vocab},
            "root_inputs": []}


def llmc(path, tokens, wide=False, version=None, count=None):
    """An llm.c shard: 256 int32 (magic, version, count), then uint16 (uint32 with ``wide``) tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240801 if wide else 20240520, version or (7 if wide else 1),
                  len(tokens) if count is None else count)
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(header.tobytes())
        handle.write(np.asarray(tokens, dtype=np.uint32 if wide else np.uint16).tobytes())
    return str(path)


def marked(path, shard, count, wide=True):
    """A shard whose token at position t is shard * 100_000 + t: a window's first token names it."""
    return llmc(path, shard * 100_000 + np.arange(count), wide=wide)


def starts(batches, steps):
    """The (shard, position) of every window the given steps read, in order."""
    out = []
    for step in steps:
        (inputs,), _kwargs, target = batches(step)
        assert torch.equal(target[:, :-1], inputs[:, 1:])
        out += [(int(first) // 100_000, int(first) % 100_000) for first in inputs[:, 0]]
    return out


def test_each_format_is_recognised_by_its_first_bytes(tmp_path):
    plain = str(tmp_path / "plain.bin")
    np.arange(300, dtype=np.uint16).tofile(plain)
    narrow = llmc(tmp_path / "narrow.bin", np.arange(300))
    wide = llmc(tmp_path / "wide.bin", np.arange(300) + 70_000, wide=True)
    array = str(tmp_path / "array.npy")
    np.save(array, np.arange(300, dtype=np.int32))
    expected = {plain: ("nanoGPT uint16", 0), narrow: ("llm.c uint16", 0), wide: ("llm.c uint32", 70_000),
                array: (".npy int32", 0)}
    for path, (name, base) in expected.items():
        file = TokenFile(path)
        assert file.format == name and len(file) == 300, (path, file.format)
        assert file.read(7, 4).tolist() == [base + 7, base + 8, base + 9, base + 10]
        assert file.read(7, 4).dtype == np.int64
    assert TokenFile(narrow).fingerprint != TokenFile(plain).fingerprint


@pytest.mark.parametrize("case, message", [
    ("version", r"llm.c header with magic 20240520 and version 3; tracepp reads version 1"),
    ("truncated", r"llm.c's header says 100 tokens \(1,224 bytes with the header\) but the file has 1,124 bytes"),
    ("short", r"starts with llm.c's magic 20240520 but has only 12 bytes, less than llm.c's 1024-byte header"),
    ("odd", r"1,001 bytes is not a whole number of uint16 tokens"),
    ("matrix", r"holds a int32 array of shape \[2, 3\]; token ids are a 1-D array"),
    ("floats", r"holds a float32 array"),
    ("npy_truncated", r"its .npy header says 1,000 tokens"),
    ("not_npy", r"not a readable .npy file"),
    ("missing", r"no such file"),
])
def test_a_bad_file_is_one_error_naming_it_and_the_fix(tmp_path, case, message):
    path = str(tmp_path / ("bad.npy" if case in ("matrix", "floats", "npy_truncated", "not_npy") else "bad.bin"))
    if case == "version":
        llmc(path, np.arange(10), version=3)
    elif case == "truncated":
        llmc(path, np.arange(50), count=100)
    elif case == "short":
        open(path, "wb").write(np.array([20240520, 1, 5], dtype=np.int32).tobytes())
    elif case == "odd":
        open(path, "wb").write(b"\1" * 1001)
    elif case == "matrix":
        np.save(path, np.zeros((2, 3), dtype=np.int32))
    elif case == "floats":
        np.save(path, np.zeros(10, dtype=np.float32))
    elif case == "npy_truncated":
        np.save(path, np.zeros(1000, dtype=np.int32))
        os.truncate(path, 600)
    elif case == "not_npy":
        open(path, "wb").write(b"tokens, not numpy")
    with pytest.raises(PipelineError, match=message) as error:
        TokenFile(path, "--eval-data")
    assert str(error.value).startswith(f"--eval-data {path}: ") and "\n" not in str(error.value)


def test_what_data_names(tmp_path):
    for name in ("b.bin", "a.bin", "c.npy", "notes.txt", ".hidden.bin"):
        open(tmp_path / name, "wb").write(b"\0\0" * 20)
    os.mkdir(tmp_path / "code")
    open(tmp_path / "code" / "x.bin", "wb").write(b"\0\0" * 20)
    folder, code = str(tmp_path), str(tmp_path / "code")
    assert corpus.expand(folder) == [os.path.join(folder, n) for n in ("a.bin", "b.bin", "c.npy")]
    assert corpus.expand(os.path.join(folder, "*.bin")) == [os.path.join(folder, n) for n in ("a.bin", "b.bin")]
    one = os.path.join(folder, "a.bin")
    assert parse_sources(one) == [(None, [one], "a")]
    assert parse_sources([one, os.path.join(folder, "b.bin")]) == [(None, [one, os.path.join(folder, "b.bin")],
                                                                   "a")]  # a shell-expanded glob: one source
    web = os.path.join(folder, "*.bin")
    weighted = [(Fraction(7, 10), [web], os.path.basename(folder)), (Fraction(3, 10), [code + "/"], "code")]
    assert parse_sources(f"0.7:{web},0.3:{code}/") == weighted
    assert parse_sources(["0.7", web, "0.3", code + "/"]) == weighted  # Megatron's --data-path 0.7 a 0.3 b
    assert parse_sources([f"0.7:{web}", f"0.3:{code}/"]) == weighted
    assert [label for _w, _p, label in parse_sources(f"1:{code},2:{code}")] == ["code", "code_1"]
    assert corpus._label("data/fineweb_train_*.bin") == "fineweb_train"


@pytest.mark.parametrize("value, message", [
    ("x:{dir}/a.bin,0.3:{dir}/", r"the weight 'x' is not a positive number; a weighted source is WEIGHT:PATH"),
    ("0:{dir}/a.bin,1:{dir}/", r"the weight '0' is not a positive number"),
    ("-1:{dir}/a.bin,1:{dir}/", r"the weight '-1' is not a positive number"),
    ("0.7:{dir}/a.bin,{dir}/", r"has a weight and other items do not"),
    ("{dir}/nothing_*.bin", r"the glob matches no file \(looked from .*\); check the folder and the pattern"),
    ("{dir}/empty", r"the folder holds no .bin or .npy token file"),
    ("{dir}/fineweb", r"the folder holds training and held-out shards \(fineweb_train_000001.bin, "
                      r"fineweb_val_000000.bin\): pass a glob of the ones you mean, e.g. '.*fineweb_train_\*.bin'"),
    ("{dir}/nope.bin", r"no such file or folder"),
    ("{dir}/short_*.bin", r"2 files of 8 tokens, none holding one window of the model's sequence length 5"),
])
def test_what_data_names_errors(tmp_path, value, message):
    llmc(tmp_path / "a.bin", np.arange(50))
    os.mkdir(tmp_path / "empty")
    llmc(tmp_path / "fineweb" / "fineweb_train_000001.bin", np.arange(50))
    llmc(tmp_path / "fineweb" / "fineweb_val_000000.bin", np.arange(50))
    llmc(tmp_path / "short_1.bin", np.arange(4))
    llmc(tmp_path / "short_2.bin", np.arange(4))
    with pytest.raises(PipelineError, match=message) as error:
        TokenBatches(value.format(dir=tmp_path), manifest())
    assert str(error.value).startswith("--data ") and "\n" not in str(error.value)


def test_epoch_order_reads_every_window_once_per_pass_reshuffled(tmp_path):
    lengths = [101, 57, 230, 3]  # 20 + 11 + 45 + 0 windows of 5 tokens (the last shard is shorter than one)
    for shard, count in enumerate(lengths):
        marked(tmp_path / f"s_{shard}.bin", shard, count)
    batches = TokenBatches(str(tmp_path / "s_*.bin"), manifest(batch=3), seed=5, order="epoch")
    every = sorted((shard, k * 5) for shard, count in enumerate(lengths) for k in range((count - 1) // 5))
    assert len(every) == 76 == batches.stream.windows[0]
    read = starts(batches, range(76))  # 228 windows: three passes, 76 not a multiple of the batch of 3
    passes = [read[0:76], read[76:152], read[152:228]]
    assert all(sorted(one) == every for one in passes)
    assert passes[0] != passes[1] != passes[2] and passes[0] != every
    assert batches.position(75) == {"tokens_seen": 76 * 3 * 5, "data_pass": 3.0}
    assert batches.position(37)["data_pass"] == pytest.approx(1.5)
    other_seed = TokenBatches(str(tmp_path / "s_*.bin"), manifest(batch=3), seed=6, order="epoch")
    assert starts(other_seed, range(26))[:76] != passes[0]


def test_permutation_is_a_bijection_in_constant_memory():
    for n in (1, 2, 3, 4, 5, 17, 1000, 4097):
        assert sorted(Permutation(n, key(1, 0, 0))(np.arange(n)).tolist()) == list(range(n))
    assert Permutation(1000, key(1, 0, 0))(np.arange(1000)).tolist() != Permutation(1000, key(1, 0, 1))(
        np.arange(1000)).tolist()
    big = Permutation(10 ** 8, key(0, 0, 0))  # 1,000 shards x 100M tokens / 1,024-token windows
    some = big(np.arange(0, 10 ** 8, 9973))
    assert len(set(some.tolist())) == len(some) and some.min() >= 0 and some.max() < 10 ** 8
    assert len(big.keys) == 6  # no table: the order is computed per index


def test_mixture_follows_its_weights():
    weights = [Fraction(7, 10), Fraction(2, 10), Fraction(1, 10)]
    blend = Blend(weights)
    seen = [0, 0, 0]
    for g in range(20_000):
        source, index = blend.pick(g)
        assert index == seen[source]  # the sample's index within its source's own stream
        seen[source] += 1
        if g % 997 == 0:
            assert blend.counts(g + 1) == seen
            assert all(abs(count - float(w) * (g + 1)) <= 3 for count, w in zip(seen, weights))
    assert Blend(["2", "1"]).counts(300) == [200, 100]


def test_mixture_sources_run_their_own_passes(tmp_path):
    marked(tmp_path / "web" / "w_0.bin", 0, 201)  # 40 windows
    marked(tmp_path / "web" / "w_1.bin", 1, 101)  # 20
    marked(tmp_path / "code" / "c_0.bin", 2, 51)  # 10
    value = f"0.75:{tmp_path}/web/*.bin,0.25:{tmp_path}/code/"
    batches = TokenBatches(value, manifest(batch=4), seed=1, order="epoch")
    read = starts(batches, range(60))  # 240 windows: 180 of web (3 passes), 60 of code (6 passes)
    web = [place for place in read if place[0] < 2]
    code = [place for place in read if place[0] == 2]
    assert len(web) == 180 and len(code) == 60
    for one in range(3):
        assert len(set(web[60 * one:60 * (one + 1)])) == 60
    for one in range(6):
        assert sorted(code[10 * one:10 * (one + 1)]) == [(2, 5 * k) for k in range(10)]
    assert batches.position(59) == {"tokens_seen": 60 * 4 * 5, "data_pass": {"web": 3.0, "code": 6.0}}
    assert batches.scalars(29) == {"data/tokens_seen": 600, "data/pass/web": 1.5, "data/pass/code": 3.0}
    assert "75% " in batches.describe() and "25% " in batches.describe()
    shuffled = TokenBatches(value, manifest(batch=4), seed=1)  # random order: the same weights
    chosen = starts(shuffled, range(50))
    assert sum(place[0] == 2 for place in chosen) == 50


def test_position_is_a_function_of_seed_step_and_data(tmp_path):
    for shard in range(3):
        marked(tmp_path / f"s_{shard}.bin", shard, 500 + 37 * shard)
    value = f"2:{tmp_path}/s_0.bin,1:{tmp_path}/s_1.bin,1:{tmp_path}/s_2.bin"
    for order in ("random", "epoch"):
        one = TokenBatches(value, manifest(), seed=3, order=order)
        other = TokenBatches(value, manifest(), seed=3, order=order)  # another rank, a restart
        later = [other(step)[0][0] for step in (9, 4, 0)]  # in any order
        assert all(torch.equal(one(step)[0][0], batch) for step, batch in zip((9, 4, 0), later))
        record = json.loads(json.dumps(data_record(one)))  # as a checkpoint keeps it
        assert Stream(record).picks(123) == one.stream.picks(123)
        assert not torch.equal(one(4)[0][0], TokenBatches(value, manifest(), seed=4, order=order)(4)[0][0])


def _shards(folder, counts, base=0):
    return [marked(os.path.join(folder, f"part_{i:03d}.bin"), base + i, count) for i, count in enumerate(counts)]


def test_a_changed_shard_is_named_and_accepted_with_a_new_pass(tmp_path):
    folder = str(tmp_path / "data")
    paths = _shards(folder, [201, 201, 101])  # 100 windows of 5 tokens
    saved = data_record(TokenBatches(folder, manifest(), seed=2, order="epoch"))
    assert check_resumed("ck/step_7", saved, data_record(TokenBatches(folder, manifest(), 2, "epoch")), 7) == saved
    moved = str(tmp_path / "moved")
    shutil.copytree(folder, moved)  # another mount point: the same data
    assert check_resumed("ck/step_7", saved, data_record(TokenBatches(moved, manifest(), 2, "epoch")), 7)[
        "sources"][0]["root"] == moved

    def change(message):
        current = data_record(TokenBatches(folder, manifest(), seed=2, order="epoch"))
        with pytest.raises(PipelineError, match=message) as error:
            check_resumed("ck/step_7", saved, current, 7)
        assert "pass --accept-data-change to train on the data as it is now from step 8 on" in str(error.value)
        return current

    marked(os.path.join(folder, "part_003.bin"), 3, 51)
    change(r"checkpoint ck/step_7 was trained on data that has changed since: data: 1 shard\(s\) added \(.*"
           r"data/part_003.bin\)")
    os.remove(os.path.join(folder, "part_003.bin"))
    os.remove(paths[2])
    change(r"data: 1 shard\(s\) removed \(.*data/part_002.bin\)")
    marked(paths[2], 7, 101)  # rewritten: the same size, other tokens
    change(r"data: 1 shard\(s\) rewritten \(.*data/part_002.bin \(same tokens count, other contents\)\)")
    marked(paths[2], 2, 151)
    current = change(r"data: 1 shard\(s\) rewritten \(.*data/part_002.bin \(101 -> 151 tokens\)\)")

    accepted = check_resumed("ck/step_7", saved, current, 7, accept=True)  # 7 steps x 4 = 28 of 100 windows read
    assert accepted["restart"]["step"] == 7 and accepted["restart"]["passes"] == {"data": 1}
    assert "101 -> 151 tokens" in accepted_note(accepted, 7) and accepted_note(accepted, 8) is None
    batches = TokenBatches(folder, manifest(), seed=2, order="epoch")
    batches.follow(accepted)
    windows = batches.stream.windows[0]
    assert windows == 110
    read = starts(batches, range(7, 7 + 55))  # from step 7 on: a new pass of the 110 windows there are now
    assert sorted(read[:110]) == sorted(set(read[:110])) and len(set(read[:110])) == 110
    assert batches.position(6 + 55 // 2)["data_pass"] < batches.position(6 + 55)["data_pass"] == 3.0
    # the next checkpoint keeps the restart: a later resume on the same data continues it
    assert check_resumed("ck/step_9", accepted, data_record(TokenBatches(folder, manifest(), 2, "epoch")),
                         9)["restart"] == accepted["restart"]
    with pytest.raises(PipelineError, match=r"with --seed 2; this run reads .* with --seed 3"):
        check_resumed("ck/step_7", saved, data_record(TokenBatches(folder, manifest(), 3, "epoch")), 7, True)


def test_a_checkpoint_of_one_file_from_before_shards_still_resumes(tmp_path):
    path = str(tmp_path / "train.bin")
    (np.arange(100) % 50).astype(np.uint16).tofile(path)
    current = data_record(TokenBatches(path, manifest(seq=5, vocab=50), seed=1))
    old = {"source": "file", "path": "/elsewhere/train.bin", "tokens": 100, "seed": 1}
    assert check_resumed("ck/step_2", old, current, 2) == current
    with pytest.raises(PipelineError, match="with --seed 3; this run reads"):
        check_resumed("ck/step_2", dict(old, seed=3), current, 2)
    with pytest.raises(PipelineError, match=r"rewritten \(.*train.bin \(99 -> 100 tokens\)\)"):
        check_resumed("ck/step_2", dict(old, tokens=99), current, 2)


def test_validation_batches_spread_over_shards_by_token_share(tmp_path):
    marked(tmp_path / "val" / "a.bin", 0, 3000)
    marked(tmp_path / "val" / "b.bin", 1, 1000)
    evals = EvalBatches(str(tmp_path / "val"), manifest(batch=4), 10)
    first = [int(x) // 100_000 for batch in evals for x in batch[0][0][:, 0]]
    assert first.count(0) == 30 and first.count(1) == 10
    again = EvalBatches(str(tmp_path / "val"), manifest(batch=4), 10)
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(evals, again))
    mixed = EvalBatches(f"1:{tmp_path}/val/a.bin,1:{tmp_path}/val/b.bin", manifest(batch=4), 10)
    first = [int(x) // 100_000 for batch in mixed for x in batch[0][0][:, 0]]
    assert first.count(0) == 20 and first.count(1) == 20


def test_ids_are_checked_on_a_sample_at_open_and_in_every_window(tmp_path, monkeypatch):
    tokens = np.zeros(5000, dtype=np.uint16)
    tokens[4000] = 77
    path = str(tmp_path / "t.bin")
    tokens.tofile(path)
    with pytest.raises(PipelineError, match=r"token id 77 \(first id >= 50 at position 4000\) is outside"):
        TokenBatches(path, manifest(vocab=50))  # 5,000 tokens: the sample at open is all of them
    monkeypatch.setattr(corpus, "SCAN_TOKENS", 1000)
    batches = TokenBatches(path, manifest(batch=8, vocab=50), order="epoch")  # the first 1,000 are fine
    with pytest.raises(PipelineError, match=r"--data .*t.bin: token id 77 \(first id >= 50 at position 4000, "
                                            r"read for step \d+\) is outside the model's vocabulary of 50"):
        for step in range(1000 // 8 + 1):  # one pass reads every window
            batches(step)


def test_maps_stay_within_their_limit(tmp_path):
    maps = Maps(limit=3)
    files = [TokenFile(marked(tmp_path / f"s{i}.bin", i, 100), maps=maps) for i in range(8)]
    for file in files * 2:
        assert file.read(10, 3).tolist() == [file.read(10, 1)[0] + k for k in range(3)]
        assert len(maps.open) <= 3


_OPEN_MANY = """
import os, sys
from tracepp.runtime.data import TokenBatches

def rss(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

manifest = {"token_input": {"leaf_index": 0, "path": "args[0]", "batch": 16, "seq": 1024, "vocab": 50304},
            "root_inputs": []}
before = rss("VmRSS:")
batches = TokenBatches(sys.argv[1], manifest, seed=0, order="epoch")
for step in range(50):
    batches(step)
print(before, rss("VmHWM:"), batches.stream.windows[0])
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status")
def test_a_thousand_sparse_shards_of_100m_tokens_open_in_bounded_memory(tmp_path):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, 100_000_000)
    for shard in range(1000):
        with open(tmp_path / f"fineweb_train_{shard:06d}.bin", "wb") as handle:
            handle.write(header.tobytes())
            handle.truncate(1024 + 2 * 100_000_000)  # sparse: 200 MB each, no blocks on disk
    result = subprocess.run([sys.executable, "-c", _OPEN_MANY, str(tmp_path / "*.bin")], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    before, peak, windows = map(int, result.stdout.split())
    assert windows == 1000 * ((100_000_000 - 1) // 1024)
    assert peak - before < 100 << 20, f"opening and reading grew the peak resident memory by {peak - before:,} bytes"


def test_prepare_tokens_writes_llmc_shards_and_still_one_file_without_a_shard_size(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_tokens", os.path.join(REPO, "examples", "prepare_tokens.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    text = str(tmp_path / "story.txt")
    open(text, "w", encoding="utf-8").write("".join(chr(97 + k % 26) for k in range(1000)))
    expected = np.frombuffer(open(text, "rb").read(), dtype=np.uint8)
    prepare.main([text, "-o", str(tmp_path / "shards"), "--shard-size", "300"])
    train = corpus.expand(str(tmp_path / "shards" / "story_train_*.bin"))
    assert [os.path.basename(path) for path in train] == [f"story_train_{k:06d}.bin" for k in range(3)]
    files = [TokenFile(path) for path in train]
    assert [file.format for file in files] == ["llm.c uint16"] * 3 and [len(file) for file in files] == [300] * 3
    assert np.concatenate([file.read(0, len(file)) for file in files]).tolist() == expected[:900].tolist()
    val = TokenFile(str(tmp_path / "shards" / "story_val_000000.bin"))
    assert val.read(0, len(val)).tolist() == expected[900:].tolist()
    wide = str(tmp_path / "wide.bin")
    prepare.write_shard(wide, np.array([70_000, 1, 2]), wide=True)
    assert TokenFile(wide).format == "llm.c uint32" and TokenFile(wide).read(0, 3).tolist() == [70_000, 1, 2]
    prepare.main([text, "-o", str(tmp_path / "flat")])
    assert sorted(os.listdir(tmp_path / "flat")) == ["train.bin", "val.bin"]
    assert TokenFile(str(tmp_path / "flat" / "train.bin")).format == "nanoGPT uint16"


def test_run_py_offers_the_data_orders_data_knows():
    # launch.py names them itself: runtime.data imports numpy, and a rank without numpy must reach the check
    # that names it (tests/test_quick_start.py)
    from tracepp.runtime import data, launch

    assert launch.DATA_ORDERS == data.ORDERS
