"""Tensor parallelism inside stages (issue 33), tier 3: torchrun on gloo, compared with eager training.

A hand-written Llama (grouped-query attention, rotary, SwiGLU, RMSNorm, tied embedding and head) at pp=2, tp=2
(4 processes) trained with AdamW and global-norm clipping equals eager within 2e-5; its checkpoints resume on
the same mesh, load into tp=1 and back (DCP reshards the DTensors); Hugging Face Llama, Qwen3 and Mixtral
train equal to eager at pp=2, tp=2. The dp=2 x pp=2 x tp=2 case (8 processes) is in
``benchmarks/tensor_parallel.py``.
"""
import os
import re
import shutil

import pytest
import torch

from test_e2e_dp import _eager_adamw
from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from util import assert_state_close, assert_trained, eager_train, initial_state, model_path, torchrun

pytestmark = pytest.mark.timeout(600)
ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")
CLIP = 1.0


def _run(out: str, nproc: int, *args: str, env=None):
    result = torchrun(out, nproc, "--quiet", *args, env_extra=env)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def _trains_equal_to_eager(path: str, out: str, nproc: int, tmp_path, env=None) -> None:
    """3 SGD steps of the folder on ``nproc`` ranks: the parameters moved, and equal to 3 eager steps of the
    unsplit model within 2e-5."""
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, nproc, "--steps", "3", "--save", ckpt, env=env)
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 3))


def _clipped_adamw_equal_to_eager(path: str, out: str, nproc: int, tmp_path, clip: float) -> dict:
    """3 steps of the model file's AdamW with the gradient norm clipped at ``clip`` (which the eager run's norms must
    exceed) on ``nproc`` ranks: the parameters moved, and equal to the eager run's; the saved state."""
    expected, norms, _losses = _eager_adamw(path, 3, clip)
    assert min(norms) > clip, "the norm must exceed the limit or clipping is not exercised"
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, nproc, "--steps", "3", "--clip-grad-norm", str(clip), "--save", ckpt)
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, expected)
    return saved


def test_llama_pp2_tp2_adamw_clip_resume_and_reshard(tmp_path):
    path = model_path("tp_llama")
    tp2, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    manifest = split_model(path, tp2, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2, tp=2))
    assert manifest["launch_command"].startswith("torchrun --nproc-per-node 4 ")
    roles = {fqn: entry["role"] for fqn, entry in manifest["tp"]["params"].items()}
    assert roles["layers.0.attn.q_proj.weight"] == roles["layers.0.mlp.up_proj.bias"] == "colwise"
    assert roles["layers.0.attn.o_proj.weight"] == roles["layers.3.mlp.down_proj.weight"] == "rowwise"
    assert roles["head.weight"] == "colwise"  # tied to the vocabulary-parallel embedding: Shard(0) on both
    script = open(os.path.join(tp2, "rank0.py")).read()
    assert "torch.ops.tracepp.tp_vocab_embedding.default" in script and "tp_all_reduce" in script
    split_model(path, tp1, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    expected, norms, _losses = _eager_adamw(path, 4, CLIP)
    assert min(norms) > CLIP, "the norm must exceed the limit or clipping is not exercised"

    # 4 steps in one go, a checkpoint after step 2
    ckpts, final = str(tmp_path / "ckpt"), str(tmp_path / "final.pt")
    _run(tp2, 4, "--steps", "4", "--clip-grad-norm", str(CLIP), "--checkpoint-dir", ckpts, "--save-every", "2",
         "--save", final)
    saved = torch.load(final)
    assert_trained(saved, path)
    assert_state_close(saved, expected)
    assert torch.equal(saved["embed.weight"], saved["head.weight"])

    # resumed at step 2 on the same mesh, and on tp=1 (the DTensor shards gathered by DCP on load)
    for folder, nproc in ((tp2, 4), (tp1, 2)):
        resumed = str(tmp_path / f"resumed_{nproc}.pt")
        _run(folder, nproc, "--steps", "4", "--clip-grad-norm", str(CLIP), "--resume", os.path.join(ckpts, "step_2"),
             "--save", resumed)
        assert_state_close(torch.load(resumed), expected)

    # and the other way: a tp=1 checkpoint resumed at tp=2 (each rank reads its shard)
    ckpts1 = str(tmp_path / "ckpt1")
    _run(tp1, 2, "--steps", "2", "--clip-grad-norm", str(CLIP), "--checkpoint-dir", ckpts1)
    resumed = str(tmp_path / "resumed_from_tp1.pt")
    _run(tp2, 4, "--steps", "4", "--clip-grad-norm", str(CLIP), "--resume", os.path.join(ckpts1, "step_2"),
         "--save", resumed)
    assert_state_close(torch.load(resumed), expected)


def test_hugging_face_llama_pp2_tp2_matches_eager(tmp_path):
    # transformers' own Llama over two pipeline ranks: the boundaries under tp (the other families run at pp1 below)
    path, out = model_path("hf_llama"), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2, tp=2))
    params = manifest["tp"]["params"]
    attention = [e["role"] for fqn, e in params.items() if "self_attn.o_proj.weight" in fqn]
    assert attention and set(attention) == {"rowwise"}  # attention sharded by heads
    _trains_equal_to_eager(path, out, 4, tmp_path)


@pytest.mark.parametrize("family,sequence_parallel", [
    ("phi3", False), ("gpt2", False), ("falcon", False), ("olmo2", False), ("gemma3", False), ("gpt_neox", False),
    ("starcoder2", False), ("qwen3", False), ("mixtral", False), ("gpt2", True), ("falcon", True), ("phi3", True)])
def test_every_familys_tp_plan_trains_equal_to_eager_at_microbatch_size_1(tmp_path, monkeypatch, family,
                                                                          sequence_parallel):
    # fused qkv/gate_up (Phi-3), Conv1D addmm and a fused c_attn (GPT-2), x @ W.T with a per-group fused qkv and
    # parallel attention and MLP (Falcon), norms over the sharded width from partial sums (OLMo2), per-head norms
    # and casts (Gemma3), a per-head fused query_key_value (GPT-NeoX), biases and LayerNorm (StarCoder2), q/k norms
    # on sharded heads (Qwen3), routed experts kept whole over tp (Mixtral); with sequence parallelism: GPT-2's
    # [batch * seq] tokens around its addmm, Falcon's two rows summed in place. One pipeline rank holds both
    # stages (2 processes; the pipeline's boundaries under tp are tested on hf_llama and tp_llama above)
    monkeypatch.setenv("TP_HF_FAMILY", family)
    path, out = os.path.join(ZOO, "tp_hf.py"), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="looped-bfs", num_microbatches=4,  # 4 samples: microbatch size 1
                           layout=Layout(pp=1, tp=2, sequence_parallel=sequence_parallel))
    params = manifest["tp"]["params"]
    if family == "mixtral":  # attention sharded by heads, the routed experts whole over tp (they shard over --ep)
        assert {e["role"] for f, e in params.items() if "self_attn.o_proj.weight" in f} == {"rowwise"}
        assert {e["role"] for f, e in params.items() if ".experts." in f} == {"replicate"}
    else:
        assert min(stage["share"]["params"] for stage in manifest["tp"]["stages"]) > 0.9
    if sequence_parallel:
        assert manifest["tp"]["sequence_parallel"]["sent"] and not any(
            stage["replicated"] for stage in manifest["tp"]["stages"])
    _trains_equal_to_eager(path, out, 2, tmp_path, env={"TP_HF_FAMILY": family})


def test_fewer_kv_heads_than_tp_shard_the_queries_and_train_equal_to_eager(tmp_path, monkeypatch):
    # Llama with 4 query heads and 2 key/value heads at --tp 4 (4 processes, one pipeline rank): each rank computes
    # its query head, the key/value projections stay whole and each rank reads the key/value head its query needs
    # (tp_head_group beside enable_gqa's attention), as Megatron-Core replicates kv heads; o_proj is row-wise
    monkeypatch.setenv("HF_FAMILY", "llama")
    path, out = os.path.join(ZOO, "hf_family.py"), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1, tp=4))
    roles = {name: manifest["tp"]["params"][f"model.layers.0.self_attn.{name}.weight"]["role"]
             for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert roles == {"q_proj": "colwise", "k_proj": "replicate", "v_proj": "replicate", "o_proj": "rowwise"}
    # transformers' sdpa path either hands the key/value heads to attention whole (enable_gqa: tp_head_group reads
    # the group) or repeats them first (repeat_kv: tp_piece reads this rank's repeated head, its gradient a part
    # carried back to the layer input's sum, split/tp_grads.py); never all heads
    script = open(os.path.join(out, "rank0.py")).read()
    attention = [line for line in script.splitlines() if "aten.scaled_dot_product_attention.default(" in line]
    assert attention and all("tp_head_group" in line or "tp_piece" in line for line in attention), attention
    assert re.search(r'scaled_dot_product_attention: "f32\[2, 1, ', script)  # one query head per rank
    _trains_equal_to_eager(path, out, 4, tmp_path, env={"HF_FAMILY": "llama"})


def test_sequence_parallel_llama_trains_equal_to_eager_and_a_dynamic_sequence_tp_cannot_split_stops(
        tmp_path, monkeypatch):
    # pp2 x tp2 with --sequence-parallel, AdamW and clipping; then a dynamic sequence (16, 8, 12, 7): the first
    # three steps train equal to eager, the fourth (7 tokens) stops every rank naming the length and the fix
    path, out = model_path("tp_llama"), str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2, tp=2, sequence_parallel=True))
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 4, "--steps", "3", "--clip-grad-norm", str(CLIP), "--save", ckpt)
    assert_state_close(torch.load(ckpt), _eager_adamw(path, 3, CLIP)[0])

    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        # torch 2.11's export adds a guard min(8*seq, 16*seq) == 8*seq to this model's dynamic sequence and refuses
        # it (seen on the lent GPU machine); 2.13 traces it. The static half above ran.
        return
    monkeypatch.setenv("TP_LLAMA_SEQ", "dynamic")
    env = {"TP_LLAMA_SEQ": "dynamic"}
    dynamic = str(tmp_path / "dynamic")
    manifest = split_model(path, dynamic, schedule="1f1b", num_microbatches=2,
                           layout=Layout(pp=2, tp=2, sequence_parallel=True))
    assert manifest["tp"]["sequence_parallel"]["sequence"] == "s_seq"
    assert manifest["values"]["layers_1_out"]["shape"] == [4, "(s_seq // 2)", 32]
    _run(dynamic, 4, "--steps", "3", "--save", ckpt, env=env)
    assert_state_close(torch.load(ckpt), _eager_adamw(path, 3, 1e9)[0])
    result = torchrun(dynamic, 4, "--quiet", "--steps", "4", env_extra=env)
    assert result.returncode != 0
    assert ("batch for step 3: sequence length 7 (s_seq) is not a multiple of --tp 2: with --sequence-parallel"
            in result.stdout + result.stderr)


def test_fused_projections_checkpoint_in_the_models_layout(tmp_path, monkeypatch):
    # Phi-3's qkv_proj and gate_up_proj: each tp rank holds its heads' rows of every part; --load of a
    # safetensors file in the model's layout cuts them; DCP checkpoints hold the model's own row order, so a tp2
    # checkpoint resumes on tp1 and a tp1 checkpoint on tp2, with the momentum buffers; --save-safetensors writes
    # the model's layout back (one pipeline rank holding both stages: 2 processes at tp2)
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("TP_HF_FAMILY", "phi3")
    env = {"TP_HF_FAMILY": "phi3"}
    path = tmp_path / "phi3.py"
    path.write_text(open(os.path.join(ZOO, "tp_hf.py")).read().replace(
        "optimizer = sgd", "def optimizer(params):\n    return torch.optim.SGD(params, lr=0.1, momentum=0.9)"))
    shutil.copy(os.path.join(ZOO, "zoo_common.py"), tmp_path)  # imported beside the model file, as in the zoo
    monkeypatch.syspath_prepend(str(tmp_path))
    path = str(path)
    tp2, tp1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    manifest = split_model(path, tp2, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1, tp=2))
    assert manifest["tp"]["params"]["model.layers.0.self_attn.qkv_proj.weight"]["segments"] == [32, 16, 16]
    split_model(path, tp1, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1))
    initial = str(tmp_path / "initial.safetensors")
    save_file({k: v.clone().contiguous() for k, v in load_model_file(path).model().state_dict().items()}, initial)
    ckpts, ckpts1 = str(tmp_path / "ckpt"), str(tmp_path / "ckpt1")
    _run(tp2, 2, "--steps", "2", "--load", initial, "--checkpoint-dir", ckpts, env=env)
    third = str(tmp_path / "third.pt")
    _run(tp1, 1, "--steps", "3", "--resume", os.path.join(ckpts, "step_2"), "--checkpoint-dir", ckpts1,
         "--save", third, env=env)
    assert_state_close(torch.load(third), eager_train(path, 3))
    trained = str(tmp_path / "trained.safetensors")
    _run(tp2, 2, "--steps", "4", "--resume", os.path.join(ckpts1, "step_3"), "--save-safetensors", trained, env=env)
    assert_state_close(load_file(trained), eager_train(path, 4))


def test_zero_bubble_schedule_splits_the_tp_backward_exactly_from_a_loaded_checkpoint(tmp_path):
    # I and W run apart: the gradient all-reduce of tp_copy falls in I, the rowwise weights' gradients in W;
    # the weights come from a state_dict file (--load), each tp rank cutting its pieces as it reads them
    path, out = model_path("tp_llama"), str(tmp_path / "out")
    split_model(path, out, schedule="interleaved-zb", num_microbatches=4, layout=Layout(pp=2, tp=2))
    initial = str(tmp_path / "initial.pt")
    torch.save(load_model_file(path).model().state_dict(), initial)
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 4, "--steps", "3", "--load", initial, "--save", ckpt)
    assert_state_close(torch.load(ckpt), _eager_adamw(path, 3, 1e9)[0])


def test_compiled_stages_keep_the_collectives_opaque(tmp_path):
    # --compile traces the stage function and its backward: the DTensor parameters become shards before the
    # compiled code, and tp_copy's backward is the tp_all_reduce op (its body would put a process group into
    # the compiled backward graph, which cannot be copied)
    path, out = model_path("tp_llama"), str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=2, split_points="auto", num_stages=1,
                layout=Layout(pp=1, tp=2))  # one stage over 2 processes: one compile each
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 2, "--steps", "2", "--compile", "--save", ckpt)
    assert_state_close(torch.load(ckpt), _eager_adamw(path, 2, 1e9)[0])


def test_a_whole_gate_scaling_sharded_features_gets_its_gradient_summed(tmp_path):
    # the gate (one feature: whole on every rank) multiplies the sharded hidden features: each rank's gradient
    # for it covers only its share of them. The graph's own metadata says the gate's value needs no gradient
    # (export records requires_grad on parameters only): the plan must follow the parameters through the graph
    path, out = model_path("tp_gated_mlp"), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2, tp=2))
    collectives = [c for stage in manifest["tp"]["stages"] for c in stage["collectives"]]
    # the gate's parts are carried back through the sigmoid and the gate's linear (every rank computes them whole)
    # to the layer's input, where they are summed with the up projection's (split/tp_grads.py): one all-reduce per
    # stage's layer input, one at the head's input; the gate's weight and bias summed once per step
    assert [c["op"] for c in collectives].count("all_reduce (backward)") == 3
    assert sorted(c["after"] for c in collectives if c["op"] == "all_reduce (gradient, once per step)") == sorted(
        f"p_layers_{k}_gate_{p}" for k in range(2) for p in ("weight", "bias"))
    _trains_equal_to_eager(path, out, 4, tmp_path)


def test_gradients_summed_once_per_step_train_equal_to_eager(tmp_path):
    # q/k norm weights over heads split among the ranks, and under --sequence-parallel every norm weight, a
    # learned temperature and a reduce-scattered bias: each rank's part of their gradients accumulates over the
    # microbatches and is summed over tp when the step ends (split/tp_grads.py), before clipping reads the norm
    path = model_path("tp_step_summed")
    for sequence_parallel in (False, True):
        out = str(tmp_path / f"out_{sequence_parallel}")
        manifest = split_model(path, out, schedule="1f1b", num_microbatches=4,
                               layout=Layout(pp=2, tp=2, sequence_parallel=sequence_parallel))
        assert any(entry.get("grad") == "partial" for entry in manifest["tp"]["params"].values())
        ckpt = str(tmp_path / "ckpt.pt")
        _run(out, 4, "--steps", "3", "--clip-grad-norm", "0.05", "--save", ckpt)
        assert_state_close(torch.load(ckpt), _eager_adamw(path, 3, 0.05)[0])


def test_a_frozen_table_read_by_the_heads_stays_frozen_and_trains_equal_to_eager(tmp_path):
    # RoFormer's sinusoidal table, an nn.Embedding made with _freeze=True: read whole beside the ranks' heads, it
    # takes no gradient and sums none; the trained parameters equal eager's, the table unchanged
    path = model_path("tp_frozen_table")
    out = str(tmp_path / "out")
    split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2, tp=2))
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 4, "--steps", "3", "--save", ckpt)
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 3))
    assert torch.equal(saved["positions.weight"], initial_state(path)["positions.weight"])


def test_a_qkv_viewed_into_parts_and_a_bias_table_by_heads_train_equal_to_eager(tmp_path):
    # the fused projection held as three segments of heads (a view into [3, heads, d]) and the relative position
    # bias table held by its columns, each rank its heads'
    path = model_path("tp_bias_table")
    for pp in (1, 2):  # at pp 2 the bias crosses the stage boundary as each rank's heads
        out = str(tmp_path / f"out{pp}")
        manifest = split_model(path, out, schedule="gpipe", num_microbatches=2, layout=Layout(pp=pp, tp=2))
        assert manifest["tp"]["params"]["relative_attention_bias.weight"]["dim"] == 1
        assert bool(manifest["tp"].get("sent")) == (pp == 2)
        _trains_equal_to_eager(path, out, 2 * pp, tmp_path)


def test_a_bias_from_the_states_read_at_each_ranks_heads_trains_equal_to_eager(tmp_path):
    # ProphetNet's relative position bias: read at each rank's heads with tp_piece, its gradient parts carried to
    # the layer input's tp_copy and its linear's weight summed once per step, at pp 2 x tp 2 with AdamW and clipping
    path = model_path("tp_bias_from_states")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=4, layout=Layout(pp=2, tp=2))
    assert any("tp_piece" in open(os.path.join(out, name)).read() for name in os.listdir(out) if name.endswith(".py"))
    assert manifest["tp"]["params"]["layers.0.attn.rel.weight"].get("grad") == "partial"
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 4, "--steps", "3", "--clip-grad-norm", "0.05", "--save", ckpt)
    assert_state_close(torch.load(ckpt), _eager_adamw(path, 3, 0.05)[0])


def test_a_buffer_written_in_place_where_a_shard_cannot_be_is_whole_from_where_it_is_made(tmp_path):
    # zeros_like of sharded heads, then a whole value (a sum over the heads) written into a slice of it: the write
    # used to be refused with a gather of the buffer's slice, so it went into a copy and the buffer stayed zero
    # (Kimi Linear's reference scan at tp 2: 1e-2 from eager). The buffer is now made whole and walked again
    path, out = model_path("tp_inplace_buffer"), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1, tp=2))
    reasons = " ".join(manifest["tp"]["stages"][0]["replicated"])
    assert "written in place by copy_" in reasons, reasons
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_a_whole_buffer_filled_in_place_is_read_at_its_piece_after_its_writes(tmp_path):
    # a scan fills a whole buffer in place, one position at a time, and the buffer is read at this rank's piece
    # beside a column-parallel gate: the piece used to be taken right after zeros_like made the buffer, before the
    # writes (RecurrentGemma's recurrent block at tp 2: 3e-2 from eager, silently)
    path, out = model_path("tp_scan_buffer"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    roles = {fqn: entry["role"] for fqn, entry in manifest["tp"]["params"].items()}
    assert roles["blocks.0.linear_y.weight"] == "colwise" and roles["blocks.0.linear_out.weight"] == "rowwise"
    assert roles["blocks.0.linear_x.weight"] == "replicate"
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_a_padded_grouped_convolution_and_concatenate_run_on_each_ranks_heads(tmp_path):
    # F.pad of the time dim, a causal convolution with one group per head (ZAYA) and torch.concatenate (xLSTM's
    # cat) keep each head's channels together: the mixer shards whole, and trains equal to eager
    path, out = model_path("tp_conv_mixer"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    roles = {fqn: entry["role"] for fqn, entry in manifest["tp"]["params"].items()}
    assert roles["blocks.0.proj.weight"] == "colwise" and roles["blocks.0.out.weight"] == "rowwise", roles
    assert not manifest["tp"]["stages"][0]["replicated"], manifest["tp"]["stages"][0]["replicated"]
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_a_gathered_low_rank_latent_is_read_whole_by_every_reader(tmp_path):
    # the queries' down-projection is column-wise with its 8-feature latent all-gathered, the up-projection
    # column-wise on its heads: its input copy used to wrap the rank's piece of the latent (Kimi Linear's forget
    # gate at tp 2: "mat1 and mat2 shapes cannot be multiplied" at the first step)
    path, out = model_path("tp_low_rank"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    params = manifest["tp"]["params"]
    assert params["blocks.0.q_a.weight"]["role"] == "colwise" and "all-gathered" in params["blocks.0.q_a.weight"]["why"]
    assert params["blocks.0.q_b.weight"]["role"] == "colwise" and params["blocks.0.o.weight"]["role"] == "rowwise"
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_parameters_read_only_at_a_ranks_channels_are_held_as_pieces(tmp_path):
    # Mamba-1's A_log (-exp(A_log)[None, :, None, :]), D, its depthwise convolution's weight and bias and dt_proj's
    # bias added on its own are read only at this rank's channels: each rank holds its piece of them (they used to
    # be whole on every rank, read at their piece), and the mixer trains equal to eager
    path, out = model_path("tp_selective_scan"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    params = manifest["tp"]["params"]
    for name in ("A_log", "D", "conv1d.weight", "conv1d.bias", "dt_proj.bias"):
        assert params[f"blocks.0.{name}"]["dim"] == 0, (name, params[f"blocks.0.{name}"])
    assert params["blocks.0.in_proj.weight"]["role"] == "colwise"
    assert params["blocks.0.out_proj.weight"]["role"] == "rowwise"
    assert manifest["tp"]["stages"][0]["share"]["params"] == 1.0
    script = open(os.path.join(out, "rank0.py")).read()  # the local shape, halved once (it used to be twice)
    assert 'A_log: "f32[16, 4]"' in script, [line for line in script.splitlines() if "A_log:" in line]
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_a_mixer_scanning_its_heads_one_by_one_runs_each_ranks_heads_and_trains_equal_to_eager(tmp_path):
    # Zamba's loop over Mamba heads (tests/models/tp_mamba_heads_loop.py): each rank scans its own 2 of 4 heads,
    # the other 2 dropped from its program, its rows of the per-head weights held
    path, out = model_path("tp_mamba_heads_loop"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    assert manifest["tp"]["params"]["blocks.0.x_proj_weight"]["dim"] == 0
    script = open(os.path.join(out, "rank0.py")).read()
    assert len(re.findall(r"= torch\.ops\.aten\.softplus\.default\(", script)) == 2  # 2 heads (the blocks folded)
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_a_scan_state_made_from_a_sharded_parameter_trains_equal_to_eager(tmp_path):
    # A.new_zeros(b, channels, state) starts the scan (tests/models/tp_mamba_fresh_state.py): A gives it only its
    # dtype, so A_log stays sharded and the state is read at each rank's channels
    path, out = model_path("tp_mamba_fresh_state"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    assert manifest["tp"]["params"]["blocks.0.A_log"]["dim"] == 0
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_heads_of_their_own_modules_computed_whole_where_cheaper_train_equal_to_eager(tmp_path):
    # Karpathy's Head modules at a context of 64: q and k whole on every rank, v and proj sharded (the plan:
    # tests/test_tensor_parallel.py)
    path, out = model_path("tp_karpathy_heads"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    assert manifest["tp"]["params"]["blocks.1.sa.heads.3.key.weight"]["role"] == "replicate"
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_adalora_adapters_held_as_pieces_beside_row_parallel_bases_train_equal_to_eager(tmp_path):
    # lora_A held as the columns x is read at beside to_out and proj (the plan: tests/test_tensor_parallel.py)
    path, out = model_path("tp_adalora"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    assert manifest["tp"]["params"]["transformer.h.0.mlp.proj.lora_A"]["dim"] == 1
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_a_mamba2_mixer_of_one_group_shards_its_heads_and_trains_equal_to_eager(tmp_path):
    # Mamba-2 with one group (the plan: tests/test_tensor_parallel.py), at pp 2 x tp 2 with AdamW and clipping
    path, out = model_path("tp_mamba2_one_group"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2, tp=2))
    assert manifest["tp"]["params"]["blocks.0.mixer.in_proj.weight"]["segments"] == [64, 64, 8, 8, 4]
    _clipped_adamw_equal_to_eager(path, out, 4, tmp_path, CLIP)


def test_a_lora_fine_tune_trains_its_adapters_equal_to_eager_and_leaves_the_base_as_it_was(tmp_path):
    # torchtune-style LoRA on every projection, the base, embedding, norms and head frozen (the plan and its bytes:
    # tests/test_plan_cost.py): pp 2 x tp 2, the model file's AdamW, clipping
    path, out = model_path("tp_lora_llama"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2, tp=2))
    assert manifest["tp"]["params"]["layers.0.q_proj.lora_a.weight"]["role"] == "replicate"
    saved = _clipped_adamw_equal_to_eager(path, out, 4, tmp_path, 0.25)  # the adapters' gradient norm: about 0.47
    initial = initial_state(path)
    for fqn, value in initial.items():
        if "lora" not in fqn:
            assert torch.equal(saved[fqn], value), f"{fqn} is frozen and changed"


def test_a_sparse_attention_indexer_keeps_the_attention_sharded_by_heads(tmp_path):
    # DeepSeek-V3.2's indexer: the low-rank query latent is read by the attention's up-projection and by the
    # indexer's, which does not widen; the heads' scores are summed over the heads with whole weights that carry a
    # gradient (read at their piece: a partial sum, all-reduced). The down-projection is gathered and every
    # up-projection shards its heads: the attention ends row-wise. (The indexer's reader used to keep the latent
    # sharded: q_b row-wise, the attention whole, o column-wise and the residual stream sharded from there on.)
    path, out = model_path("tp_indexer"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    roles = {fqn: entry["role"] for fqn, entry in manifest["tp"]["params"].items()}
    for layer in (0, 1):
        assert [roles[f"blocks.{layer}.{name}.weight"] for name in ("q_a", "q_b", "wq", "kv", "o")] == [
            "colwise", "colwise", "colwise", "colwise", "rowwise"], roles
        assert roles[f"blocks.{layer}.wk.weight"] == "replicate"  # one key head, normalised over its features


def test_a_value_sharded_inside_its_heads_is_gathered_at_the_attention_alone(tmp_path):
    # ZAYA's value heads are two projections side by side: at tp 2 each rank holds a piece of every value head's
    # features, so the attention gathers the value and reads it at this rank's heads, the queries and keys staying
    # on theirs. The attention used to gather all three, and q, k, v and o were all replicated (ZAYA: 0.90 -> 0.98)
    path, out = model_path("tp_split_value"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    roles = {fqn: entry["role"] for fqn, entry in manifest["tp"]["params"].items()}
    for block in (0, 1):
        assert roles[f"blocks.{block}.q.weight"] == roles[f"blocks.{block}.k.weight"] == "colwise", roles
        assert roles[f"blocks.{block}.o.weight"] == "rowwise", roles
    # nothing else reads block 0's value projections: kept whole; block 1's gate keeps them column-wise, and its
    # value is gathered, then cut to this rank's heads
    assert roles["blocks.0.v_now.weight"] == roles["blocks.0.v_prev.weight"] == "replicate", roles
    assert roles["blocks.1.v_now.weight"] == roles["blocks.1.v_prev.weight"] == "colwise", roles
    script = open(os.path.join(out, "rank0.py")).read()
    assert re.search(r"tp_scatter\.default\(tp_all_gather_default\w*, 1\)", script), script
    _trains_equal_to_eager(path, out, 2, tmp_path)


def test_per_head_tables_and_3d_expert_weights_shard_with_their_heads(tmp_path):
    # Inkling's relative position bias per head (states sharded on their heads @ a bank [r, extent]: a linear over
    # rows sharded before their features, the bank whole, its gradient summed), picked by distance with gather
    # along the last dim and masked with where(cond, x, -inf); a short convolution over time by pad, unfold and flip
    # with static taps read as taps.T.view(heads, d, k) (held as pieces); a shared expert of 3-D weights read
    # through bmm(x, W.transpose(1, 2)) (column- then row-wise). All of it used to stay whole
    path, out = model_path("tp_head_tables"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=1, tp=2))
    params = manifest["tp"]["params"]
    assert [params[f"blocks.0.{name}"]["role"] for name in ("r.weight", "gate", "up", "down", "o.weight")] == [
        "colwise", "colwise", "colwise", "rowwise", "rowwise"], params
    assert params["blocks.0.taps"]["dim"] == 1 and params.get("blocks.0.bank", {}).get("dim") is None
    assert not manifest["tp"]["stages"][0]["replicated"], manifest["tp"]["stages"][0]["replicated"]
    _trains_equal_to_eager(path, out, 2, tmp_path)
