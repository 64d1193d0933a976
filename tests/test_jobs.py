"""Tier 1: the pieces of a long job on plain data, in one process: token files and their errors, window
positions, the manifest's token input, checkpoint verification, fallback and pruning, the failure message of a
full disk, the stop request, progress lines."""
import errno
import json
import os
import signal

import numpy as np
import pytest
import torch

from tracepp.driver import check_model
from tracepp.runtime.mesh import Layout
from tracepp.runtime import checkpoint
from tracepp.runtime.data import (EvalBatches, TokenBatches, TokenFile, check_resumed, data_record, token_input,
                                  window_starts)
from tracepp.runtime.failure import PipelineError
from tracepp.runtime.job import Progress, StopRequest, clock
from util import REPO, model_path

MANIFEST = {"token_input": {"leaf_index": 0, "path": "args[0]", "batch": 3, "seq": 5, "vocab": 50},
            "root_inputs": []}


def _tokens(tmp_path, values, name="t.bin"):
    path = str(tmp_path / name)
    if name.endswith(".npy"):
        np.save(path, np.asarray(values))
    else:
        np.asarray(values, dtype=np.uint16).tofile(path)
    return path


def test_token_batches_are_shifted_windows_drawn_from_seed_and_step(tmp_path):
    path = _tokens(tmp_path, np.arange(100) % 50)
    source = TokenBatches(path, MANIFEST, seed=7)
    (inputs,), kwargs, target = source(4)
    assert inputs.shape == (3, 5) and target.shape == (3, 5) and inputs.dtype == torch.int64 and kwargs == {}
    assert torch.equal(target[:, :-1], inputs[:, 1:])
    starts = window_starts(7, 4, 3, 100 - 5)
    assert inputs[:, 0].tolist() == [s % 50 for s in starts]
    assert torch.equal(source(4)[0][0], TokenBatches(path, MANIFEST, seed=7)(4)[0][0])  # another rank, a restart
    assert not torch.equal(source(4)[0][0], source(5)[0][0])
    assert not torch.equal(source(4)[0][0], TokenBatches(path, MANIFEST, seed=8)(4)[0][0])


def test_npy_of_any_integer_dtype_and_fixed_eval_batches(tmp_path):
    path = _tokens(tmp_path, (np.arange(60) % 50).astype(np.int32), "v.npy")
    assert len(TokenFile(path)) == 60
    evals = list(EvalBatches(path, MANIFEST, 2))
    assert len(evals) == 2 and evals[0][0][0].shape == (3, 5)
    again = list(EvalBatches(path, MANIFEST, 2))
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(evals, again))
    assert evals[-1][2][-1, -1].item() == 59 % 50  # the windows reach the end of the file


def test_token_file_errors_name_the_file_and_the_numbers(tmp_path):
    with pytest.raises(PipelineError, match=r"--data .*nope.bin: no such file"):
        TokenFile(str(tmp_path / "nope.bin"))
    short = _tokens(tmp_path, [1, 2, 3], "short.bin")
    with pytest.raises(PipelineError, match=r"3 tokens, shorter than one window of the model's sequence length 5"):
        TokenBatches(short, MANIFEST)
    big = _tokens(tmp_path, [1] * 20 + [77] + [2] * 20, "big.bin")
    with pytest.raises(PipelineError, match=r"token id 77 \(first id >= 50 at position 20\) is outside the model's "
                                            r"vocabulary of 50"):
        TokenBatches(big, MANIFEST)
    floats = str(tmp_path / "f.npy")
    np.save(floats, np.zeros(10, dtype=np.float32))
    with pytest.raises(PipelineError, match="float32 array"):
        TokenFile(floats, "--eval-data")


def test_manifest_records_the_token_input_and_refuses_other_models():
    manifest = check_model(os.path.join(REPO, "examples", "gpt.py"), num_microbatches=4, layout=Layout(pp=2))
    assert manifest["token_input"] == {"leaf_index": 0, "path": "args[0]", "batch": 8, "seq": 32, "vocab": 256}
    float_model = check_model(model_path("crash_on_step"), num_microbatches=2, layout=Layout(pp=2))
    assert float_model["token_input"] is None
    with pytest.raises(PipelineError, match=r"this model's batched inputs are args\[0\] \(float32"):
        token_input(float_model)


def test_resumed_data_must_be_the_same_stream(tmp_path):
    path = _tokens(tmp_path, np.arange(100) % 50)
    record = data_record(TokenBatches(path, MANIFEST, seed=1))
    check_resumed("ck/step_2", record, dict(record))
    check_resumed("ck/step_2", None, record)  # written before data was recorded
    with pytest.raises(PipelineError, match="with --seed 1; this run reads .* with --seed 2"):
        check_resumed("ck/step_2", record, dict(record, seed=2))
    with pytest.raises(PipelineError, match="was trained on the model file's batch"):
        check_resumed("ck/step_2", data_record(None), record)


def _save(directory, step, model, keep_last=0):
    return checkpoint.save(str(directory), step, dict(model.state_dict()), None, [],
                           {"model_sha256": "x", "fqns": [], "optimizer": None, "world_size": 1}, 0,
                           keep_last=keep_last)


def test_checkpoints_verify_fall_back_and_prune(tmp_path):
    model = torch.nn.Linear(64, 64)
    assert checkpoint.usable(str(tmp_path / "missing"), 0, 1) is None  # a first start
    for step in (1, 2, 3):
        _save(tmp_path, step, model, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3"]
    info = json.load(open(tmp_path / "step_3" / checkpoint.INFO))
    assert ".metadata" in info["files"] and all(size > 0 for size, _crc in info["files"].values())
    assert checkpoint.usable(str(tmp_path), 0, 1) == (3, str(tmp_path / "step_3"))

    shard = next(n for n in os.listdir(tmp_path / "step_3") if n.endswith(".distcp"))
    data = bytearray(open(tmp_path / "step_3" / shard, "rb").read())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    open(tmp_path / "step_3" / shard, "wb").write(bytes(data))
    said = []
    assert checkpoint.usable(str(tmp_path), 0, 1, report=said.append) == (2, str(tmp_path / "step_2"))
    assert f"{shard} has the recorded size" in said[0] and "trying the one before it" in said[0]

    os.truncate(tmp_path / "step_2" / shard, 10)
    with pytest.raises(checkpoint.CheckpointError, match=rf"no usable checkpoint.*{shard} has 10 bytes"):
        checkpoint.usable(str(tmp_path), 0, 1, report=said.append)
    # verification is shared: rank 1 of 2 checks the other half of the files
    names = sorted(info["files"])
    assert not set(checkpoint._share(names, 0, 2)) & set(checkpoint._share(names, 1, 2))
    assert sorted(checkpoint._share(names, 0, 2) + checkpoint._share(names, 1, 2)) == names


def test_full_disk_message_names_the_cause():
    class Wrapped(BaseException):
        failures = {1: OSError(errno.ENOSPC, "No space left on device")}

    assert checkpoint._write_failure(Wrapped("x")).startswith("no space left on device (rank 1)")
    assert checkpoint._write_failure(OSError(errno.EFBIG, "File too large")).startswith("file too large")


def test_stop_request_and_progress():
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested == "SIGUSR1"
    finally:
        stop.uninstall()
    assert clock(3725.2) == "1:02:05"
    progress = Progress(last_step=20)
    for seconds in (1.0, 3.0, 2.0):
        progress.record(seconds)
    assert progress.eta(13) == 2.0 * 7
