"""Expert parallelism, tier 3: torchrun on gloo at pp2 x dp2 x ep2 (4 processes), compared with eager training.

Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA, a dense first layer, a shared expert, group-limited routing) train equal
to eager under three schedules (interleaved zero-bubble's split backward through the all-to-all included) and
both data-parallel engines; tokens per expert in --metrics equal an eager
count of the router's choices; AdamW with clipping; checkpoints resume on the same mesh, from ep2 into ep1 and
back, and --load of a safetensors file reads each rank's experts; tensor parallelism on the same stages; expert
weights stored with the expert dim second or last (brought to the grouped matmul by permutes) sharded on that dim
and saved, checkpointed and loaded in the model's layout.
"""
import json
import os
import shutil

import pytest
import torch

from test_e2e_dp import _eager_adamw
from tracepp.driver import split_model
from tracepp.modelfile import load_model_file
from tracepp.runtime.mesh import Layout
from util import assert_state_close, assert_trained, eager_train, model_path, torchrun

pytestmark = pytest.mark.timeout(600)
ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo")
CLIP = 0.5


def _run(out: str, nproc: int, *args: str, env=None):
    result = torchrun(out, nproc, "--quiet", *args, env_extra=env)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def _eager_expert_counts(path: str, step: int) -> list:
    """Per block of routed experts, the tokens each expert takes in ``step`` of eager training (the router's
    top-k choices over the whole global batch), from a hook on each experts module."""
    model_file = load_model_file(path)
    model, module = model_file.model(), model_file.module
    counts = []

    def count(experts, args):
        experts_count = getattr(experts, "num_experts", None) or experts.gate_up_proj.shape[0]
        counts.append(torch.bincount(args[1].reshape(-1), minlength=experts_count).tolist())
    hooks = [m.register_forward_pre_hook(count) for name, m in model.named_modules() if name.endswith(".experts")]
    args, kwargs, _target = module.batch(step)
    with torch.no_grad():
        model(*args, **kwargs)
    for hook in hooks:
        hook.remove()
    return counts


@pytest.mark.parametrize("name,schedule,mode", [("mixtral", "1f1b", "fsdp"), ("qwen3_moe", "gpipe", "ddp"),
                                                ("deepseek_v3", "interleaved-zb", "fsdp"), ("moe_sentinel", "1f1b", "fsdp"),
                                                ("gpt_oss", "1f1b", "fsdp")])
def test_moe_families_pp2_dp2_ep2_train_equal_to_eager(tmp_path, monkeypatch, name, schedule, mode):
    # moe_sentinel (tests/models): a mask of the rows routed to no expert between the grouped matmuls, as
    # transformers 5.17 writes its experts; gpt_oss (tests/zoo/hf_family.py): a bias per expert gathered for each
    # sorted row between the matmuls (it moves with the rows: each row keeps its local expert), its clamped SwiGLU
    # on interleaved features and its attention sinks
    path = model_path(name) if name == "moe_sentinel" else os.path.join(ZOO, name + ".py")
    if name == "gpt_oss":
        monkeypatch.setenv("HF_FAMILY", name)
        path = os.path.join(ZOO, "hf_family.py")
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule=schedule, num_microbatches=2,
                           layout=Layout(pp=2, dp=2, ep=2, dp_mode=mode))
    assert manifest["launch_command"].startswith("torchrun --nproc-per-node 4 ")
    script = "".join(open(os.path.join(out, f"rank{r}.py")).read() for r in range(2))
    assert "torch.ops.tracepp.ep_dispatch.default" in script and "torch.ops.tracepp.ep_combine.default" in script
    if name == "gpt_oss":
        assert all(block["biases"] for block in manifest["ep"]["blocks"])
        assert "torch.ops.tracepp.ep_expert_ids.default" in script
    ckpt, metrics = str(tmp_path / "ckpt.pt"), str(tmp_path / "metrics.jsonl")
    _run(out, 4, "--steps", "3", "--save", ckpt, "--metrics", metrics, env={"HF_FAMILY": name})
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, 3))
    # tokens per expert: the worst block's busiest expert and the mean, as an eager count of the router says
    first = json.loads(open(metrics).readline())
    blocks = _eager_expert_counts(path, 0)
    assert len(blocks) == len(manifest["ep"]["blocks"])
    assert first["moe_tokens_per_expert_mean"] == max(sum(c) / len(c) for c in blocks)
    assert first["moe_tokens_per_expert_max"] == max(max(c) for c in blocks)
    assert first["moe_imbalance"] == pytest.approx(max(max(c) / (sum(c) / len(c)) for c in blocks))
    assert first["moe_dropped"] == 0


def test_adamw_clipping_and_checkpoints_across_ep_sizes(tmp_path, monkeypatch):
    # Qwen3-MoE with AdamW and clipping: 4 steps in one go (a checkpoint after step 2) equal eager, saved whole as
    # safetensors; the step-2 checkpoint (experts sharded over ep2 in DCP) resumes on ep1 for a step, whose
    # checkpoint resumes on ep2 to the end; the safetensors file loads back with --load, each rank reading its
    # own experts
    from safetensors.torch import load_file

    shutil.copy(os.path.join(ZOO, "zoo_common.py"), tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = str(tmp_path / "qwen3_moe.py")
    with open(path, "w") as handle:
        handle.write(open(os.path.join(ZOO, "qwen3_moe.py")).read().replace(
            "optimizer = sgd", "def optimizer(params):\n    return torch.optim.AdamW(params, lr=1e-3)"))
    ep2, ep1 = str(tmp_path / "ep2"), str(tmp_path / "ep1")
    manifest = split_model(path, ep2, num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2))
    assert manifest["ep"]["params"]["model.layers.0.mlp.experts.gate_up_proj"]["local"][0] == 4
    split_model(path, ep1, schedule="looped-bfs", num_microbatches=2, layout=Layout(pp=1, dp=2))  # 2 processes
    expected, norms, _losses = _eager_adamw(path, 4, CLIP)
    assert min(norms) > CLIP, "the norm must exceed the limit or clipping is not exercised"
    ckpts, ckpts1, final = str(tmp_path / "ckpt"), str(tmp_path / "ckpt1"), str(tmp_path / "final.safetensors")
    clip = ("--clip-grad-norm", str(CLIP))
    _run(ep2, 4, "--steps", "4", *clip, "--checkpoint-dir", ckpts, "--save-every", "2", "--save-safetensors", final)
    assert_state_close(load_file(final), expected)
    third = str(tmp_path / "third.pt")
    _run(ep1, 2, "--steps", "3", *clip, "--resume", os.path.join(ckpts, "step_2"), "--checkpoint-dir", ckpts1,
         "--save", third)
    assert_state_close(torch.load(third), _eager_adamw(path, 3, CLIP)[0])
    resumed = str(tmp_path / "resumed_from_ep1.pt")
    _run(ep2, 4, "--steps", "4", *clip, "--resume", os.path.join(ckpts1, "step_3"), "--save", resumed)
    assert_state_close(torch.load(resumed), expected)
    # --load: the trained weights back in, one more step from there equals eager's fifth step
    loaded = str(tmp_path / "loaded.pt")
    _run(ep2, 4, "--steps", "1", "--load", final, "--save", loaded)
    assert_state_close(torch.load(loaded), _eager_adamw_from(path, load_file(final), step=0))


def _eager_adamw_from(path: str, initial: dict, step: int) -> dict:
    """One AdamW step of the unsplit model from ``initial`` on ``batch(step)`` (a fresh optimizer, as --load)."""
    model_file = load_model_file(path)
    model = model_file.model()
    model.load_state_dict(initial, strict=False)
    optimizer = model_file.module.optimizer(list(model.parameters()))
    args, kwargs, target = model_file.module.batch(step)
    model_file.module.loss_fn(model(*args, **kwargs), target).backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tensor_and_expert_parallel_on_the_same_stages(tmp_path, monkeypatch):
    # tp_hf's Mixtral (4 heads, 2 kv heads, 4 experts) at pp2 x dp2 x ep2 x tp2: 8 processes; attention sharded
    # over tp, experts over ep
    monkeypatch.setenv("TP_HF_FAMILY", "mixtral")
    path, out = os.path.join(ZOO, "tp_hf.py"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, layout=Layout(pp=2, dp=2, ep=2, tp=2))
    assert manifest["tp"]["params"]["model.layers.0.self_attn.o_proj.weight"]["role"] == "rowwise"
    assert manifest["ep"]["params"]["model.layers.0.mlp.experts.down_proj"]["local"][0] == 2
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 8, "--steps", "2", "--save", ckpt, env={"TP_HF_FAMILY": "mixtral"})
    assert_state_close(torch.load(ckpt), eager_train(path, 2))


def test_compiled_stages_keep_the_all_to_all_opaque(tmp_path):
    # the whole model one stage over dp2 x ep2 (2 processes: one compile each)
    path, out = os.path.join(ZOO, "mixtral.py"), str(tmp_path / "out")
    split_model(path, out, num_microbatches=2, split_points="auto", num_stages=1, layout=Layout(pp=1, dp=2, ep=2))
    ckpt = str(tmp_path / "ckpt.pt")
    _run(out, 2, "--steps", "2", "--compile", "--save", ckpt)
    assert_state_close(torch.load(ckpt), eager_train(path, 2))


def test_experts_stored_on_any_dim_shard_there_and_checkpoint_in_the_models_layout(tmp_path):
    # tests/models/moe_expert_dims.py: torchtitan's experts with w1 stored [dim, hidden, experts] and w2 [dim, experts,
    # hidden], brought to [experts, in, out] by permutes: each ep rank holds its experts of each weight's own expert
    # dim (Shard(2), Shard(1), Shard(0)); dp2 x ep2, one stage (2 processes). Saved whole in the model's layout, in
    # the step-1 DCP checkpoint as in the safetensors file, and --load of that file (each rank cutting its experts)
    from safetensors.torch import load_file

    from tracepp.runtime.weights import open_checkpoint

    path, out = model_path("moe_expert_dims"), str(tmp_path / "out")
    manifest = split_model(path, out, num_microbatches=2, split_points="auto", num_stages=1,
                           layout=Layout(pp=1, dp=2, ep=2))
    params = manifest["ep"]["params"]
    assert {fqn.rsplit(".", 1)[1]: (p["dim"], p["local"]) for fqn, p in params.items()} == {
        "w1_DFE": (2, [32, 32, 2]), "w2_DEF": (1, [32, 2, 32]), "w3_EFD": (0, [2, 32, 32])}
    ckpts, final = str(tmp_path / "ckpt"), str(tmp_path / "final.safetensors")
    _run(out, 2, "--steps", "2", "--checkpoint-dir", ckpts, "--save-every", "1", "--save-safetensors", final)
    assert_trained(load_file(final), path)
    assert_state_close(load_file(final), eager_train(path, 2))
    reader = open_checkpoint(os.path.join(ckpts, "step_1"))
    step1 = reader.read({fqn: "model." + fqn for fqn in params})  # DCP keys: "model." + FQN
    assert_state_close(step1, {fqn: value for fqn, value in eager_train(path, 1).items() if fqn in params})
    loaded = str(tmp_path / "loaded.pt")
    _run(out, 2, "--steps", "1", "--load", final, "--save", loaded)
    assert_state_close(torch.load(loaded), _eager_adamw_from(path, load_file(final), step=0))
