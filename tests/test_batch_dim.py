"""A model file's ``batch_dim``: batches laid out ``[seq, batch]``, as PyTorch's own transformer and recurrent modules
read them by default (``batch_first=False``), cut into microbatches along dim 1; a sequence-first module that the
microbatches would reach along its sequence stops the split (``tracepp/sequence_first.py``); PyTorch's
``nn.MultiheadAttention`` under ``--tp`` (its packed ``in_proj_weight`` unflattened into q, k and v)."""
import pytest
import torch

from tracepp.driver import check_model, split_model
from tracepp.modelfile import load_model_file
from tracepp.runtime.batching import MicrobatchSplitter
from tracepp.runtime.failure import PipelineError
from tracepp.runtime.loading import load_spec
from tracepp.runtime.mesh import Layout
from tracepp.sequence_first import SequenceFirstError
from util import assert_state_close, assert_trained, eager_train, model_path, torchrun

PATH = model_path("torch_encoder_lm")


def test_a_sequence_first_module_reached_along_its_sequence_stops_the_split(monkeypatch):
    # nn.TransformerEncoderLayer(batch_first=False) fed [seq, batch] ids with no batch_dim: tracepp would cut dim 0,
    # the sequences, into microbatches, and train on stretches of every sequence with nothing said
    monkeypatch.setenv("SEQ_FIRST", "1")
    monkeypatch.setenv("NO_BATCH_DIM", "1")
    with pytest.raises(SequenceFirstError, match=r"'encoder\.layers\.0\.self_attn' is sequence-first .*input "
                                                 r"\[8, 4, 64\].*Declare `batch_dim = 1`"):
        check_model(PATH, num_microbatches=2, layout=Layout(pp=2))


def test_where_the_sizes_cannot_tell_the_batch_warning_names_the_sequence_first_modules(monkeypatch):
    # 16 positions in 4 microbatches of 4 beside a batch of 4: the module's input [4, 4, 64] could be either way round,
    # so the watch says nothing; the outputs on the microbatches differ from the whole batch's, and the warning names
    # the sequence-first modules and batch_dim
    monkeypatch.setenv("SEQ_FIRST", "1")
    monkeypatch.setenv("NO_BATCH_DIM", "1")
    manifest = check_model(PATH, num_microbatches=4, layout=Layout(pp=2))
    warned = " ".join(manifest["warnings"])
    assert "depends on the other samples of its batch" in warned
    assert "sequence-first modules (batch_first=False: 'encoder.layers.0.self_attn'" in warned
    assert "declare `batch_dim = 1`" in warned


def test_batch_dim_1_cuts_the_inputs_and_the_target_along_dim_1(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQ_FIRST", "1")
    manifest = split_model(PATH, str(tmp_path / "out"), schedule="gpipe", num_microbatches=2, layout=Layout(pp=2))
    assert manifest["batch_dim"] == 1 and manifest["batch_size"] == 4
    assert not manifest.get("warnings")  # the outputs on microbatches cut along dim 1 are the whole batch's
    module = load_model_file(PATH).module
    splitter = MicrobatchSplitter(manifest, load_spec(manifest, "in_spec"))
    (ids,), _kwargs, target = module.batch(1)
    cut = splitter.split(1, (ids,), {}, target, torch.device("cpu"))
    assert [leaves[0].shape for leaves in cut.leaves] == [(16, 2), (16, 2)]
    assert torch.equal(cut.leaves[1][0], ids[:, 2:]) and torch.equal(cut.targets[1], target[:, 2:])
    # contiguous, as the whole batch is: labml's loss views the target (target.view(-1)), which a strided piece of
    # a [seq, batch] tensor cut along dim 1 refuses ("view size is not compatible with input tensor's size and stride")
    assert all(leaves[0].is_contiguous() for leaves in cut.leaves) and all(t.is_contiguous() for t in cut.targets)
    with pytest.raises(PipelineError, match=r"has 3 samples but the pipeline was traced with 4"):
        splitter.split(1, (ids[:, :3],), {}, target[:, :3], torch.device("cpu"))


def test_context_and_sequence_parallel_spread_dim_0_of_sequence_first_inputs(monkeypatch):
    # --cp and --sequence-parallel read the sequence from dim 1 of the first batched input and were refused for
    # batch_dim = 1 (every labml-nn decoder is [seq, batch]); the sequence is now the other dim, the loss traced on a
    # microbatch cut along dim 1
    monkeypatch.setenv("SEQ_FIRST", "1")
    manifest = check_model(PATH, num_microbatches=2, layout=Layout(pp=1, cp=2))
    assert manifest["cp"]["sequence"] == "16"
    assert manifest["cp"]["verified"]["status"] == "verified", manifest["cp"]["verified"]
    manifest = check_model(PATH, num_microbatches=2, layout=Layout(pp=1, tp=2, sequence_parallel=True))
    assert manifest["tp"]["sequence_parallel"]["sequence"] == "16"
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]


@pytest.mark.parametrize("seq_first", ["0", "1"])
def test_multihead_attention_shards_its_packed_projection_by_heads(seq_first, monkeypatch):
    # nn.MultiheadAttention's in_proj: linear(x, in_proj_weight).unflatten(-1, (3, e)), then q, k and v selected. The
    # unflatten had no tp rule and the projection stayed whole (0.58 of each stage); at a microbatch of one sample a
    # dim of 1 before the parts ([seq, 1, 3, e]) was taken for the parts. Now at Megatron's bytes, both layouts
    monkeypatch.setenv("SEQ_FIRST", seq_first)
    for microbatches in (4, 2):  # 1 and 2 samples
        manifest = check_model(PATH, num_microbatches=microbatches, layout=Layout(pp=2, tp=2))
        assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
        entry = manifest["tp"]["params"]["encoder.layers.0.self_attn.in_proj_weight"]
        assert entry["role"] == "colwise" and entry["segments"] == [64, 64, 64]
        for stage in manifest["tp"]["stages"]:
            assert stage["share"]["params"] >= 0.96, stage["share"]
            for moved, megatron in stage["layers"].values():
                assert moved == megatron, (moved, megatron)


@pytest.mark.parametrize("layout", [Layout(pp=2), Layout(pp=1, dp=2), Layout(pp=1, cp=2),
                                    Layout(pp=1, tp=2, sequence_parallel=True)], ids=["pp2", "dp2", "cp2", "tp2sp"])
def test_sequence_first_model_trains_equal_to_eager(layout, monkeypatch, tmp_path):
    # each replica takes its samples along dim 1 too (Pipeline._replica_slice)
    monkeypatch.setenv("SEQ_FIRST", "1")
    out = str(tmp_path / "out")
    split_model(PATH, out, schedule="gpipe", num_microbatches=2, layout=layout)
    ckpt = str(tmp_path / "trained.pt")
    result = torchrun(out, 2, "--steps", "3", "--save", ckpt, "--quiet")
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    saved = torch.load(ckpt)
    assert_trained(saved, PATH)
    assert_state_close(saved, eager_train(PATH, 3))


def test_multihead_attention_given_three_tensors_shards_its_packed_projection():
    # SpeechBrain permutes query, key and value apart before nn.MultiheadAttention, so torch's in-projection chunks
    # in_proj_weight into three (a cut of the parameter itself): --tp 2 crashed in the rewrite, "KeyError:
    # p_layers_0_in_proj_weight" (the cut's dim read from the walk's placements, where a parameter has none)
    manifest = check_model(model_path("tp_mha_distinct_qkv"), num_microbatches=2, layout=Layout(pp=1, tp=2))
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]
    entry = manifest["tp"]["params"]["layers.0.in_proj_weight"]
    assert entry["role"] == "colwise" and entry["segments"] == [64, 64, 64], entry
    assert manifest["tp"]["stages"][0]["share"]["params"] >= 0.99, manifest["tp"]["stages"][0]["share"]


def test_multihead_attention_given_three_tensors_tp2_trains_equal_to_eager(tmp_path):
    path, out = model_path("tp_mha_distinct_qkv"), str(tmp_path / "out")
    split_model(path, out, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1, tp=2))
    ckpt = str(tmp_path / "trained.pt")
    result = torchrun(out, 2, "--steps", "3", "--save", ckpt, "--quiet")
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 3, lr=0.1))


@pytest.mark.parametrize("seq_first", ["0", "1"])
def test_multihead_attention_tp2_trains_equal_to_eager(seq_first, monkeypatch, tmp_path):
    monkeypatch.setenv("SEQ_FIRST", seq_first)
    out = str(tmp_path / "out")
    split_model(PATH, out, schedule="looped-bfs", num_microbatches=4, layout=Layout(pp=1, tp=2))
    ckpt = str(tmp_path / "trained.pt")
    result = torchrun(out, 2, "--steps", "3", "--save", ckpt, "--quiet")
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    saved = torch.load(ckpt)
    assert_trained(saved, PATH)
    assert_state_close(saved, eager_train(PATH, 3))
