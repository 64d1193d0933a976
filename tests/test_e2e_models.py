"""Tier 3: models torch.distributed.pipelining cannot train, split by tracepp and trained under torchrun (gloo).

Tied embedding/LM head across 2 ranks, a skip connection from stage 0 to stage 2, a bool mask and integer
position ids read on every stage with a None/scalar kwarg and a tuple/dict output, a rotary cache written into a
buffer on stage 0 and read on stage 1 (rotary-embedding-torch's, nGPT's), and Hugging Face Llama
(tied) and GPT-2 built from tiny configs. After 3 SGD steps the saved checkpoint equals eager training of
the unsplit model within 2e-5, holds every alias FQN of a tied weight, and loads strictly.
"""
import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from tracepp.codegen.manifest import load_manifest
from tracepp.report.stages import stage_table
from tracepp.modelfile import load_model_file
from util import assert_state_close, assert_trained, eager_train, model_path, run_ok

STEPS = 3
# model file -> (ranks, microbatches, needs transformers)
MODELS = {"tied_lm": (2, 4, False), "skip3": (3, 4, False), "mask_kwargs": (2, 4, False),
          "hf_llama": (2, 2, True), "hf_gpt2": (2, 2, True),
          "buffer_cache": (2, 4, False)}  # a cache written into a buffer on stage 0 and read on stage 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_eager(tmp_path, name, schedule):
    ranks, microbatches, needs_hf = MODELS[name]
    if needs_hf:
        pytest.importorskip("transformers")
    path = model_path(name)
    out = str(tmp_path / "out")
    manifest = split_model(path, out, schedule=schedule, num_microbatches=microbatches, layout=Layout(pp=ranks))
    assert len(manifest["stages"]) == ranks
    ckpt = str(tmp_path / "ckpt.pt")
    hf_folder = tmp_path / "hf"
    extra = ["--save-safetensors", str(hf_folder / "model.safetensors")] if needs_hf else []
    result = run_ok(out, ranks, "--steps", str(STEPS), "--save", ckpt, *extra)
    assert f"step {STEPS}/{STEPS}" in result.stdout
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, STEPS))
    model = load_model_file(path).model()
    model.load_state_dict(saved)  # strict: every key, persistent buffers included, nothing extra
    for shared in manifest["shared"]:  # every alias of a tied weight is in the checkpoint, equal
        first = saved[shared["aliases"][0]]
        for alias in shared["aliases"]:
            assert alias in saved and torch.equal(saved[alias], first), alias
    if needs_hf:  # --save-safetensors: from_pretrained reads it; a tied weight is stored once, as HF does
        from safetensors.torch import load_file

        stored = load_file(str(hf_folder / "model.safetensors"))
        assert not any(alias in stored for alias in ("lm_head.weight",)), sorted(stored)
        model.config.save_pretrained(str(hf_folder))
        loaded = type(model).from_pretrained(str(hf_folder))
        assert_state_close({k: v for k, v in loaded.state_dict().items() if k in saved}, saved, atol=0)


TIED = {"tied_lm": ["embed.weight", "head.weight"],
        "hf_llama": ["lm_head.weight", "model.embed_tokens.weight"],
        "hf_gpt2": ["lm_head.weight", "transformer.wte.weight"]}


@pytest.mark.parametrize("name", list(TIED))
def test_inspect_lists_shared_weight(tmp_path, name):
    if MODELS[name][2]:
        pytest.importorskip("transformers")
    out = str(tmp_path / "out")
    manifest = split_model(model_path(name), out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    assert [sorted(s["aliases"]) for s in manifest["shared"]] == [TIED[name]]
    assert manifest["shared"][0]["stages"] == [0, 1]
    table = stage_table(load_manifest(out))
    shared_part = table.split("shared parameters", 1)[1]
    row = next(line for line in shared_part.splitlines() if TIED[name][0] in line)
    assert all(alias in row for alias in TIED[name]) and row.rstrip().endswith("0, 1"), table
