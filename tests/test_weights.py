"""Planning on the meta device, and each rank materialising only its own weights (runtime/weights.py).

Tier 2: a meta-built trace splits into the same stage graphs as a real one; per-module init does not depend
on the split; checkpoint readers (safetensors, HF index folder, torch file, torch.distributed.checkpoint)
return the tensors asked for. Tier 3: torchrun runs that start from a checkpoint train to eager training's
parameters, and a bad checkpoint stops every rank with a message naming the problem.
"""
import json
import os

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.modelfile import load_model_file
from tracepp.runtime import weights
from tracepp.runtime.failure import PipelineError
from tracepp.split.partition import split
from tracepp.trace import trace
from util import assert_state_close, assert_trained, eager_train, model_path, run_ok, torchrun


def _stage_summary(graph):
    """Per stage: generated code, state FQNs, node targets, sends and receives. ``aten.contiguous`` nodes are
    dropped: on meta, SDPA's output strides differ from the CPU kernel's, so export records a ``.contiguous()``
    (a copy, same values) that the CPU trace elides."""
    import copy

    result = []
    for stage in graph.stages:
        stage_graph = copy.deepcopy(stage.graph)
        for node in list(stage_graph.nodes):
            if node.target is torch.ops.aten.contiguous.default:
                node.replace_all_uses_with(node.args[0])
                stage_graph.erase_node(node)
        code = stage_graph.python_code(root_module="self").src
        state = [(graph.state[name].fqn, list(graph.state[name].aliases)) for name in stage.state]
        targets = [str(node.target) for node in stage_graph.nodes]
        result.append((code, state, targets, stage.outputs, stage.received))
    return result


@pytest.mark.parametrize("name, points", [("tied_lm", ["layers.2"]),
                                          ("hf_llama", None)])
def test_meta_trace_splits_like_real_trace(name, points):
    model_file = load_model_file(model_path(name))
    real = trace(model_file, 2)
    meta = trace(model_file, 2, on_meta=True)
    assert all(t.is_meta for t in meta.program.state_dict.values()), "meta trace holds real weights"
    assert not meta.notes
    real_graph = split(real, points or model_file.split_points, 2)
    meta_graph = split(meta, points or model_file.split_points, 2)
    assert _stage_summary(meta_graph) == _stage_summary(real_graph)
    real_shapes = {k: (list(v.shape), v.dtype) for k, v in real.program.state_dict.items()}
    assert {k: (list(v.shape), v.dtype) for k, v in meta.program.state_dict.items()} == real_shapes


def test_split_writes_no_weights_and_meta_failure_falls_back(tmp_path):
    out = str(tmp_path / "out")
    manifest = split_model(model_path("hf_llama"), out, num_microbatches=2, layout=Layout(pp=2))
    assert not os.path.exists(os.path.join(out, "weights"))
    sizes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    assert sizes < 2_000_000
    assert all(s["forward_flops"] for s in manifest["stages"]), "FLOP counting needs to work on meta"
    reads_values = tmp_path / "reads.py"
    reads_values.write_text(
        "import torch\n"
        "def model():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "    assert m[0].weight.sum().item() != 0\n"
        "    return m\n"
        "def example_inputs():\n"
        "    return (torch.randn(4, 4),)\n")
    manifest = split_model(str(reads_values), str(tmp_path / "out2"), num_microbatches=2, layout=Layout(pp=2))
    assert any("meta device" in note and "real weights" in note for note in manifest["notes"])


def _rank_states(out, init):
    with open(os.path.join(out, "manifest.json")) as handle:
        manifest = json.load(handle)
    user = load_model_file(os.path.join(out, "model_file.py")).module
    merged = {}
    for rank in range(manifest["plan"]["num_ranks"]):
        state = weights.load_rank_state(out, manifest, rank, torch.device("cpu"), user, init=init)
        owned = weights.state_entries(manifest, rank)
        assert set(state) == set(owned), "a rank materialised more (or less) than its stages read"
        merged.update(state)
    return merged


def test_per_module_init_does_not_depend_on_the_split(tmp_path):
    path = model_path("tied_lm")
    split_model(path, str(tmp_path / "a"), num_microbatches=2, split_points=["layers.1"], layout=Layout(pp=2))
    split_model(path, str(tmp_path / "b"), schedule="gpipe", num_microbatches=2,
                split_points=["layers.1", "layers.2", "layers.3"], layout=Layout(pp=4))
    first, second = _rank_states(str(tmp_path / "a"), "per-module"), _rank_states(str(tmp_path / "b"), "per-module")
    assert set(first) == set(second)
    for fqn in first:
        assert torch.equal(first[fqn], second[fqn]), fqn
    eager = load_model_file(path).model().state_dict()
    assert not torch.equal(first["layers.0.fc.weight"], first["layers.1.fc.weight"]), "seeds must differ per module"
    assert first["layers.0.fc.weight"].std() > 0 and eager["layers.0.fc.weight"].shape == first["layers.0.fc.weight"].shape
    for fqn, tensor in _rank_states(str(tmp_path / "a"), "model").items():  # the default equals eager model()
        assert torch.equal(tensor, eager[fqn]), fqn


def _write_hf_folder(state: dict, folder) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for shard, names in shards.items():
        save_file({k: state[k].contiguous() for k in names}, os.path.join(folder, shard))
        weight_map.update({k: shard for k in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


def _checkpoint_state(path):
    torch.manual_seed(123)  # not model()'s seed: loading must be what sets the weights
    state = load_model_file(path).model().state_dict()
    state = {k: torch.randn_like(v) * 0.1 if v.is_floating_point() else v for k, v in state.items()}
    if "head.weight" in state:  # tied_lm: one tensor under two names
        state["head.weight"] = state["embed.weight"].clone()
    return state


def test_state_saved_through_state_dict_hooks_is_not_held_state():
    """torchtitan's fused qkv holds ``wqkv`` and its state_dict hook saves ``wq``/``wk``/``wv`` cut from it: the held
    state (what the split records and the ranks train) is ``wqkv``; the manifest says the saved layout differs, and
    ``in_model_layout`` gives the model's own ``state_dict()`` from the held tensors. A tied weight is held under
    both names, and its model saves no other layout."""
    from tracepp.codegen.emit import _saves_another_layout

    user = load_model_file(model_path("torchtitan_fused_qkv")).module
    model = user.model()
    held = weights.held_state(model)
    assert "layers.0.attention.qkv_linear.wqkv.weight" in held
    assert not any(".wq." in fqn or ".wk." in fqn or ".wv." in fqn for fqn in held)
    assert _saves_another_layout(model)
    saved = weights.in_model_layout(user, {fqn: tensor.detach().clone() for fqn, tensor in held.items()})
    assert_state_close(saved, model.state_dict(), atol=0)
    tied = load_model_file(model_path("tied_lm")).model()
    assert {"embed.weight", "head.weight"} <= set(weights.held_state(tied)) and not _saves_another_layout(tied)


def test_checkpoint_readers_return_what_is_asked(tmp_path):
    from safetensors.torch import save_file
    import torch.distributed.checkpoint as dcp

    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.int64),
             "c": torch.randn(2).to(torch.bfloat16)}
    save_file(state, str(tmp_path / "x.safetensors"))
    torch.save(state, str(tmp_path / "x.pt"))
    _write_hf_folder(state, str(tmp_path / "hf"))
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for where in ("x.safetensors", "x.pt", "hf", "dcp"):
        reader = weights.open_checkpoint(str(tmp_path / where))
        assert reader.metadata()["a.weight"] == ([3, 4], "float32"), where
        got = reader.read({"first": "a.weight", "third": "c"})
        assert set(got) == {"first", "third"}
        assert torch.equal(got["first"], state["a.weight"]) and torch.equal(got["third"], state["c"]), where


def test_check_checkpoint_names_missing_and_wrong_shapes(tmp_path):
    from safetensors.torch import save_file

    out = str(tmp_path / "out")
    manifest = split_model(model_path("tied_lm"), out, num_microbatches=2, layout=Layout(pp=2))
    state = _checkpoint_state(model_path("tied_lm"))
    del state["head.weight"]  # the tied alias: loads from embed.weight
    ok = str(tmp_path / "ok.safetensors")
    save_file({**state, "extra.weight": torch.zeros(1)}, ok)
    keys = weights.check_checkpoint(weights.open_checkpoint(ok), manifest, 1)
    tied = [fqn for fqn in keys if fqn in ("embed.weight", "head.weight")]
    assert len(tied) == 1 and keys[tied[0]] == "embed.weight"
    del state["layers.3.fc.bias"]
    state["layers.0.fc.weight"] = torch.zeros(3, 3)
    bad = str(tmp_path / "bad.safetensors")
    save_file(state, bad)
    with pytest.raises(PipelineError) as error:
        weights.check_checkpoint(weights.open_checkpoint(bad), manifest, 1)
    assert "layers.3.fc.bias" in str(error.value) and "layers.0.fc.weight: checkpoint [3, 3], model [16, 16]" in str(error.value)


@pytest.mark.parametrize("layout", ["safetensors", "hf-folder"])
def test_train_from_checkpoint_equals_eager(tmp_path, layout):
    from safetensors.torch import save_file

    path = model_path("tied_lm")
    out = str(tmp_path / "out")
    split_model(path, out, num_microbatches=2, layout=Layout(pp=2))
    state = _checkpoint_state(path)
    if layout == "safetensors":
        checkpoint = str(tmp_path / "init.safetensors")
        save_file({k: v for k, v in state.items() if k != "embed.weight"}, checkpoint)  # tied: the head's key only
    else:
        checkpoint = str(tmp_path / "hf")
        _write_hf_folder(state, checkpoint)
    ckpt = str(tmp_path / "trained.pt")
    run_ok(out, 2, "--steps", "2", "--load", checkpoint, "--save", ckpt, "--quiet")
    trained = torch.load(ckpt)
    assert_state_close(trained, eager_train(path, 2, initial=state))
    assert (trained["layers.0.fc.weight"] - state["layers.0.fc.weight"]).abs().max() > 1e-4


def test_bad_checkpoint_stops_every_rank(tmp_path):
    from safetensors.torch import save_file

    out = str(tmp_path / "out")
    split_model(model_path("tied_lm"), out, num_microbatches=2, layout=Layout(pp=2))
    result = torchrun(out, 2, "--load", str(tmp_path / "nowhere.safetensors"), timeout=90)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"[tracepp rank {rank}] error: --load {tmp_path / 'nowhere.safetensors'}: no such file" in result.stderr
    state = _checkpoint_state(model_path("tied_lm"))
    del state["norm.bias"]
    state["layers.1.fc.bias"] = torch.zeros(4)
    save_file(state, str(tmp_path / "bad.safetensors"))
    result = torchrun(out, 2, "--load", str(tmp_path / "bad.safetensors"), timeout=90)
    assert result.returncode != 0 and "step 1" not in result.stdout
    for rank in (0, 1):
        line = next(l for l in result.stderr.splitlines() if l.startswith(f"[tracepp rank {rank}] error: --load"))
        assert "norm.bias" in line and "layers.1.fc.bias: checkpoint [4], model [16]" in line
