"""Context parallelism (issue 48), tier 3: torchrun on gloo, compared with eager training of the unsplit model.

Four runs of 4 processes cover the matrix by combining dimensions (the wider one, every family and schedule, is
``benchmarks/context_parallel.py exact``, cited in docs/context-parallel.md):

* the hand-written Llama (GQA, rotary from ``arange``, a tied head) at pp2 x cp2 under interleaved zero-bubble
  with AdamW and clipping; its checkpoint resumes on cp1, whose checkpoint resumes on cp2;
* the same Llama at cp2 x tp2 with sequence parallelism and a dynamic sequence (16, 8, 12 tokens), then 7 tokens,
  which stops every rank naming the length; and at cp2 x tp2 without it;
* Hugging Face Mixtral at pp2 x cp2 with ``--ep 2`` taken from the cp ranks, targets padded with ignore_index
  unevenly over the cp ranks.
"""
import os
import re

import pytest
import torch

from test_e2e_dp import _eager_adamw
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import assert_state_close, assert_trained, eager_train, model_path, torchrun

pytestmark = pytest.mark.timeout(600)
ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")
CLIP = 1.0


def _run(out: str, nproc: int, *args: str, env=None):
    result = torchrun(out, nproc, "--quiet", *args, env_extra=env)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def _checkpoint_state(path: str, tmp_path) -> dict:
    """A DCP checkpoint's parameters, read back in one process (``model.<fqn>`` -> tensor)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = str(tmp_path / f"{os.path.basename(path)}.pt")
    dcp_to_torch_save(path, flat)
    return {k[len("model."):]: v for k, v in torch.load(flat, weights_only=False).items() if k.startswith("model.")}


def test_llama_cp2_zero_bubble_adamw_and_checkpoints_across_cp_sizes(tmp_path):
    path = model_path("tp_llama")
    cp2, cp1 = str(tmp_path / "cp2"), str(tmp_path / "cp1")
    manifest = split_model(path, cp2, schedule="interleaved-zb", num_microbatches=4, layout=Layout(pp=2, cp=2))
    assert manifest["launch_command"].startswith("torchrun --nproc-per-node 4 ")
    script = open(os.path.join(cp2, "rank0.py")).read()
    assert "torch.ops.tracepp.cp_shard.default(idx, 1)" in script and "cp_all_gather" in script
    assert "torch.ops.tracepp.cp_positions.default(16" in script  # rotary and causal positions: this rank's
    assert '"loss": loss_forward' in open(os.path.join(cp2, "rank1.py")).read()
    split_model(path, cp1, schedule="interleaved-zb", num_microbatches=4, layout=Layout(pp=2))
    expected, norms, _losses = _eager_adamw(path, 4, CLIP)
    assert min(norms) > CLIP, "the norm must exceed the limit or clipping is not exercised"
    ckpts, ckpts1, final = str(tmp_path / "ckpt"), str(tmp_path / "ckpt1"), str(tmp_path / "final.pt")
    clip = ("--clip-grad-norm", str(CLIP))
    _run(cp2, 4, "--steps", "4", *clip, "--checkpoint-dir", ckpts, "--save-every", "2", "--save", final)
    saved = torch.load(final)
    assert_trained(saved, path)
    assert_state_close(saved, expected)
    # the cp2 checkpoint (FSDP shards over the cp ranks) resumes on cp1 for a step, whose checkpoint resumes on cp2
    third = str(tmp_path / "third.pt")
    _run(cp1, 2, "--steps", "3", *clip, "--resume", os.path.join(ckpts, "step_2"), "--checkpoint-dir", ckpts1,
         "--save", third)
    assert_state_close(torch.load(third), _eager_adamw(path, 3, CLIP)[0])
    resumed = str(tmp_path / "resumed.pt")
    _run(cp2, 4, "--steps", "4", *clip, "--resume", os.path.join(ckpts1, "step_3"), "--save", resumed)
    assert_state_close(torch.load(resumed), expected)


def test_cp2_tp2_sequence_parallel_with_a_dynamic_sequence(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_LLAMA_SEQ", "dynamic")  # 16, 8, 12 tokens, then 7: not a multiple of 4 (2 x cp, cp x tp)
    path = model_path("tp_llama")
    out, ckpts = str(tmp_path / "out"), str(tmp_path / "ckpt")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=2,
                           layout=Layout(pp=1, cp=2, tp=2, sequence_parallel=True))
    assert manifest["cp"]["sequence"] == "s_seq" and manifest["tp"]["sequence_parallel"]
    result = torchrun(out, 4, "--quiet", "--steps", "4", "--checkpoint-dir", ckpts, "--save-every", "1",
                      env_extra={"TP_LLAMA_SEQ": "dynamic"})
    assert result.returncode != 0
    assert "batch for step 3: sequence length 7 (s_seq) is not a multiple of 4" in result.stderr
    assert "--cp 2" in result.stderr and "--tp 2" in result.stderr
    state = _checkpoint_state(os.path.join(ckpts, "step_3"), tmp_path)
    state.setdefault("embed.weight", state.get("head.weight"))  # the tied weight is written once
    assert_state_close(state, eager_train(path, 3))


def test_cp2_tp2_without_sequence_parallelism_trains_equal_to_eager(tmp_path):
    # the plan tests/test_verify_cp.py holds to Megatron's bytes (the keys no longer gathered across tp for the causal
    # mask's length, the residual stream whole): trained 3 steps on 4 ranks
    path = model_path("tp_llama")
    out, saved = str(tmp_path / "out"), str(tmp_path / "trained.pt")
    split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=1, cp=2, tp=2))
    _run(out, 4, "--steps", "3", "--save", saved)
    state = torch.load(saved)
    assert_trained(state, path)
    assert_state_close(state, eager_train(path, 3))


def test_mixtral_cp2_with_experts_over_the_cp_ranks_and_uneven_padding(tmp_path, monkeypatch):
    monkeypatch.setenv("CP_HF_FAMILY", "mixtral")
    monkeypatch.syspath_prepend(ZOO)
    path = os.path.join(ZOO, "cp_hf.py")
    out, final, metrics = str(tmp_path / "out"), str(tmp_path / "final.pt"), str(tmp_path / "m.jsonl")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2, cp=2, ep=2))
    assert manifest["ep"]["params"]["model.layers.0.mlp.experts.gate_up_proj"]["local"][0] == 2
    # the padding is uneven over the ranks: at cp 2, rank 0 holds positions 0-3 and 12-15 of each sample
    target = __import__("cp_hf").batch(0)[2]
    rank0 = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    ignored = (target == -100)
    assert int(ignored[:, rank0].sum()) != int(ignored.sum()) - int(ignored[:, rank0].sum())
    _run(out, 4, "--steps", "2", "--save", final, "--metrics", metrics, env={"CP_HF_FAMILY": "mixtral"})
    saved = torch.load(final)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 2))
    # tokens per expert counted on each rank's own tokens, summed over dp x cp: the eager count of the batch
    import json

    from test_e2e_ep import _eager_expert_counts

    first = json.loads(open(metrics).readline())
    counts = _eager_expert_counts(path, 0)
    assert first["moe_tokens_per_expert_max"] == max(max(block) for block in counts)
    assert first["moe_tokens_per_expert_mean"] == max(sum(block) / len(block) for block in counts)


def test_attention_spelled_as_einsum_trains_at_cp2(tmp_path):
    """x-transformers' and PaLM's einsum attention (``tests/models/cp_einsum_attention.py``) at pp 2 x cp 2: the keys
    and values gathered, the causal mask cut to each rank's query rows, the loss's ``.float()``; 3 steps equal
    to eager (refused before: "einsum ... mixes the positions of the sequence")."""
    path, out = model_path("cp_einsum_attention"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2, cp=2))
    assert manifest["cp"]["verified"]["status"] == "verified"
    # stage 0 (x-transformers' layer): the 2 key/value heads gathered, tiled to the 4 query heads after the exchange
    # (``k.repeat(1, 2, 1, 1)``: the bytes moved are the key/value heads')
    assert [g["shape"] for g in manifest["cp"]["stages"][0]["gathered"]] == [["2", "16", "32"], ["2", "2", "16", "16"]]
    script = open(os.path.join(out, "rank0.py")).read()
    assert re.search(r"repeat\w*: \"[^\"]*\" = torch\.ops\.aten\.repeat\.default\(cp_all_gather_default_1, "
                     r"\[1, 2, 1, 1\]\)", script)
    final = str(tmp_path / "final.pt")
    _run(out, 4, "--steps", "3", "--save", final)
    saved = torch.load(final)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 3, lr=0.1))


def test_a_loop_scan_on_the_whole_sequence_trains_equal_to_eager_at_cp2(tmp_path):
    """``tests/models/cp_loop_scan.py`` (attention, then Mamba's selective scan as a loop over positions) at pp 2 x
    cp 2: the scan runs each rank's own positions' steps, the state entering its chunks carried from the chunks
    before (``cp_linear_scan``; it ran on the whole sequence at every cp rank before), Griffin's window on the whole
    sequence, the attention on each rank's positions; 3 steps equal to eager (refused before). The window, a slice of
    the gathered sequence written into in place, failed in backward while the all-gather returned a view of a
    temporary ("Output 0 of Slice is a view and is being modified inplace", recurrentgemma at cp 2)."""
    path, out, saved = model_path("cp_loop_scan"), str(tmp_path / "out"), str(tmp_path / "trained.pt")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2, cp=2))
    assert [bool(stage["whole"]) for stage in manifest["cp"]["stages"]] == [True, False]
    assert all(stage["scans"] for stage in manifest["cp"]["stages"])
    _run(out, 4, "--steps", "3", "--save", saved)
    state = torch.load(saved)
    assert_trained(state, path)
    assert_state_close(state, eager_train(path, 3))
