"""A loss that is a mean over the tokens its target does not ignore (``split/token_mean.py``): found at split, each
microbatch weighed by its counted tokens at run time, trained against eager where padding falls unevenly over the
microbatches and the data-parallel replicas; what cannot be followed is named in a warning."""
import shutil
import textwrap

import pytest
import torch

from tracepp.driver import check_model, split_model
from tracepp.runtime.batching import MicrobatchSplitter, token_counts
from tracepp.runtime.mesh import Layout
from util import assert_trains_like_eager, model_path

OWN = model_path("padded_own_loss")
LOSS_FN = model_path("padded_loss_fn")


def test_a_model_s_own_loss_over_labels_cut_from_its_input_is_found():
    # PaLM-rlhf's loss: labels seq[:, 1:] of the model's one input, pad id 0 ignored
    manifest = check_model(OWN, num_microbatches=2, layout=Layout(pp=2))
    found = manifest["token_mean"]
    assert {k: found[k] for k in ("source", "leaf", "ignore_index")} == {"source": "input", "leaf": 0,
                                                                          "ignore_index": 0}, found
    assert found["slices"] == [[1, 1, 9223372036854775807, 1]], found
    assert found["op"].startswith("cross_entropy_loss at padded_own_loss.py:"), found
    assert manifest["warnings"] == []


def test_a_loss_fn_over_the_target_is_found_and_weighs_microbatches_by_their_tokens():
    manifest = check_model(LOSS_FN, num_microbatches=2, layout=Layout(pp=2))
    assert {k: manifest["token_mean"][k] for k in ("source", "leaf", "slices", "ignore_index")} == {
        "source": "target", "leaf": 0, "slices": [], "ignore_index": -100}, manifest["token_mean"]
    from padded_loss_fn import batch  # noqa: E402 - the model file's own batches

    args, kwargs, target = batch(0)
    splitter = MicrobatchSplitter(manifest)
    batches = splitter.split(0, args, kwargs, target, torch.device("cpu"))
    counted = [int((labels != -100).sum()) for labels in target.tensor_split(2)]  # 2 + 6 and 8 + 8 tokens
    assert counted == [8, 16]
    assert batches.scales == [8 / 24, 16 / 24]  # not the samples' [1/2, 1/2]
    assert token_counts(manifest["token_mean"], [], target, lambda t: t.tensor_split(4)) == [2, 6, 8, 8]


def test_cp_names_the_cut_of_an_input_of_l_plus_1_tokens():
    # the model shifts its own input (seq[:, :-1], seq[:, 1:]): its 9 tokens cut into no cp's 2 x cp chunks; the
    # refusal said "[none: the sequence is too short]" and named no op (PaLM-rlhf, titans, AutoregressiveWrapper)
    from tracepp.split.context_parallel import ContextParallelError

    with pytest.raises(ContextParallelError) as error:
        check_model(OWN, num_microbatches=2, layout=Layout(pp=1, cp=2))
    message = str(error.value)
    assert "[none: 9 is odd]" in message and "too short" not in message, message
    assert "slice (aten.slice.Tensor) at padded_own_loss.py:" in message, message


def test_no_microbatches_no_token_count():
    assert check_model(LOSS_FN, num_microbatches=1, layout=Layout(pp=2))["token_mean"] is None


_MODEL = '''
import torch
import torch.nn.functional as F
from padded_loss_fn import example_inputs, model  # noqa: F401 - its LM: embedding, 2 blocks, a head of 32


def example_target():
    return torch.randint(0, 32, (4, 8))


def loss_fn(logits, labels):
    {loss}
'''


def _lm(tmp_path, loss: str) -> str:
    """A model file beside a copy of ``padded_loss_fn.py`` (whose model it imports) with ``loss_fn`` ``loss``."""
    shutil.copy(LOSS_FN, tmp_path)
    path = tmp_path / "lm.py"
    path.write_text(textwrap.dedent(_MODEL).replace("{loss}", loss))
    return str(path)


@pytest.mark.parametrize("loss, reason", [
    ("return F.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1), weight=logits.new_ones(32) * 2)",
     "it weighs classes"),
    ("return F.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1)) + 0.01 * logits.pow(2).mean()",
     "the loss is not one such mean times a constant"),
    ("return F.cross_entropy(logits.reshape(-1, 32), (labels + 1).reshape(-1) % 32)",
     "its target is computed (remainder.Scalar at"),
])
def test_a_token_mean_that_cannot_be_counted_is_named_in_a_warning(loss, reason, tmp_path):
    manifest = check_model(_lm(tmp_path, loss), num_microbatches=2, layout=Layout(pp=2))
    assert manifest["token_mean"] is None
    warning, = manifest["warnings"]
    assert "a mean over the tokens its target does not ignore (cross_entropy_loss at lm.py:" in warning, warning
    assert reason in warning, warning


def test_a_loss_fn_that_does_not_trace_is_said_to_be_weighed_by_samples(tmp_path):
    # a constant made inside loss_fn stops its trace on meta tensors: nothing checked, and the split says so
    loss = "return F.cross_entropy(logits.transpose(1, 2), labels, weight=torch.linspace(0.5, 1.5, 32))"
    manifest = check_model(_lm(tmp_path, loss), num_microbatches=2, layout=Layout(pp=2))
    assert manifest["token_mean"] is None and manifest["warnings"] == []
    assert any(note.startswith("loss_fn was not traced (") and "weighed by their samples" in note
               for note in manifest["notes"]), manifest["notes"]


def test_soft_labels_are_a_mean_over_samples_not_counted(tmp_path):
    # a cross-entropy over class probabilities ignores nothing: no count, no warning
    loss = "return F.cross_entropy(logits.transpose(1, 2), F.one_hot(labels, 32).float().transpose(1, 2))"
    manifest = check_model(_lm(tmp_path, loss), num_microbatches=2, layout=Layout(pp=2))
    assert manifest["token_mean"] is None and manifest["warnings"] == [], manifest["warnings"]


def test_eval_without_a_target_returns_the_outputs():
    # no target, no loss: the microbatches keep their samples' shares (the Pipeline API's eval_step)
    manifest = check_model(LOSS_FN, num_microbatches=2, layout=Layout(pp=2))
    from padded_loss_fn import batch  # noqa: E402

    args, kwargs, _target = batch(0)
    assert MicrobatchSplitter(manifest).split(0, args, kwargs, None, torch.device("cpu")).scales == [0.5, 0.5]


def test_a_loss_times_a_constant_is_still_counted(tmp_path):
    loss = "return 0.5 * F.cross_entropy(logits.transpose(1, 2), labels.long())"
    manifest = check_model(_lm(tmp_path, loss), num_microbatches=2, layout=Layout(pp=2))
    assert manifest["token_mean"]["source"] == "target" and manifest["warnings"] == [], manifest


def test_hugging_face_s_shift_of_labels_padded_with_the_ignored_index_is_followed(tmp_path):
    # transformers' ForCausalLMLoss: labels padded by one ignored token at the end, then [..., 1:]: a Llama trained
    # with padded labels moved 2.1e-2 from eager at pp 2, now 7.5e-9 (docs/guide.md)
    loss = """labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, 32), shift.view(-1).to(logits.device), ignore_index=-100)"""
    manifest = check_model(_lm(tmp_path, loss), num_microbatches=2, layout=Layout(pp=2))
    assert manifest["token_mean"]["slices"] == [[1, 1, 9, 1]], manifest["token_mean"]  # of the labels before the pad
    padded = torch.tensor([[5, 6, -100, -100], [7, 8, 9, 1]])
    assert token_counts(manifest["token_mean"], [], padded, lambda t: t.tensor_split(2)) == [1, 3]


@pytest.mark.parametrize("path", [OWN, LOSS_FN], ids=["own_loss", "loss_fn"])
def test_padding_spread_unevenly_trains_equal_to_eager(path, tmp_path):
    # the first microbatch half padding, the second none: 2.0e-2 from eager before
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    assert_trains_like_eager(path, out, 2, tmp_path)


def test_a_microbatch_of_padding_alone_adds_nothing(tmp_path):
    # the first microbatch all ignored: its mean is 0/0 (NaN), its weight 0; eager's one mean counts the others
    path = tmp_path / "all_padded.py"
    path.write_text(textwrap.dedent('''
        from padded_loss_fn import loss_fn, model, optimizer  # noqa: F401
        from padded_loss_fn import batch as padded


        def batch(step):
            args, kwargs, labels = padded(step)
            labels[:2] = -100  # samples 0 and 1, the first microbatch, are padding alone
            return args, kwargs, labels


        def example_inputs():
            return batch(0)[0]


        def example_target():
            return batch(0)[2]
        '''))
    shutil.copy(LOSS_FN, tmp_path)  # beside it, as a user's own module is (the ranks import it from there)
    out = str(tmp_path / "out")
    assert split_model(str(path), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))["token_mean"]
    assert_trains_like_eager(str(path), out, 2, tmp_path)


def test_padding_spread_unevenly_over_replicas_trains_equal_to_eager(tmp_path):
    # dp 2 x pp 2: the first replica's samples half padding, the second's none; DDP averages the replicas, each
    # microbatch weighed by its tokens over the global batch's
    out = str(tmp_path / "out")
    split_model(OWN, out, schedule="1f1b", num_microbatches=1, layout=Layout(pp=2, dp=2))
    assert_trains_like_eager(OWN, out, 4, tmp_path)
