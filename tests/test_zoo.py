"""Tier 3: a model zoo of real model code nobody on the project wrote, trained 2 steps on 2 ranks vs eager.

Tiny configs built from config (nothing downloaded) of Hugging Face GPT-2 (written ``import transformers as
tf``), Mistral, Qwen2, Qwen3, Gemma2, Phi-3, the mixtures of experts Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA,
a dense first layer, a shared expert), BERT (encoder), T5
(encoder-decoder) and ViT, and a nanoGPT-style plain-PyTorch GPT in a package beside its model file. Every
model file imports ``zoo_common`` from its own folder, as a user's model file imports its own code. Each is
split at explicit split points with one schedule; two of them also run a small schedule grid.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import HERE, REPO, assert_state_close, assert_trained, eager_train, run_ok, torchrun

pytest.importorskip("transformers")

ZOO = os.path.join(HERE, "zoo")
STEPS = 2
HF_MODELS = ["gpt2_tf", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "mixtral", "qwen3_moe", "deepseek_v3", "bert", "t5",
             "vit"]
# model -> split points giving 4 stages, for the schedules that place two stages on each rank
FOUR_STAGES = {"nanogpt": ["transformer.h.0", "transformer.h.1", "transformer.ln_f"],
               "mistral": ["model.layers.0", "model.layers.1", "model.norm"]}


def zoo_path(name: str) -> str:
    return os.path.join(ZOO, name + ".py")


def _train_and_compare(tmp_path, path: str, out: str) -> None:
    ckpt = str(tmp_path / "ckpt.pt")
    run_ok(out, 2, "--steps", str(STEPS), "--save", ckpt, "--quiet")
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, STEPS))


@pytest.mark.parametrize("name", HF_MODELS)
def test_zoo_matches_eager(tmp_path, name):
    path, out = zoo_path(name), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=2, layout=Layout(pp=2))
    assert len(manifest["stages"]) == 2 and all(stage["num_params"] > 0 for stage in manifest["stages"])
    _train_and_compare(tmp_path, path, out)


@pytest.mark.parametrize("name", ["mistral", "mixtral", "gpt2_tf", "bert", "nanogpt"])
def test_zoo_automatic_split_matches_eager(tmp_path, name):
    """No split points at all (--split-points auto): cuts between the repeated blocks by the cost model."""
    path, out = zoo_path(name), str(tmp_path / "out")
    manifest = split_model(path, out, schedule="1f1b", num_microbatches=2, split_points="auto", layout=Layout(pp=2))
    assert len(manifest["stages"]) == 2 and all(stage["num_params"] > 0 for stage in manifest["stages"])
    _train_and_compare(tmp_path, path, out)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("name", list(FOUR_STAGES))
def test_zoo_schedule_grid(tmp_path, name, schedule):
    path, out = zoo_path(name), str(tmp_path / "out")
    points = FOUR_STAGES[name] if schedule != "gpipe" else None
    split_model(path, out, schedule=schedule, num_microbatches=4, split_points=points, layout=Layout(pp=2))
    _train_and_compare(tmp_path, path, out)


def test_lazy_library_output_class_is_imported_before_the_spec_is_read(tmp_path):
    """`import transformers as tf`: nothing imports transformers.modeling_outputs on the ranks but the runtime."""
    manifest = split_model(zoo_path("gpt2_tf"), str(tmp_path / "out"), num_microbatches=2, layout=Layout(pp=2))
    assert "transformers.modeling_outputs:CausalLMOutputWithCrossAttentions" in manifest["spec_types"]
    assert ZOO in manifest["import_paths"]


def _copy_sources(target: str) -> str:
    os.makedirs(target)
    for name in ("nanogpt.py", "zoo_common.py"):
        shutil.copyfile(os.path.join(ZOO, name), os.path.join(target, name))
    shutil.copytree(os.path.join(ZOO, "zoo_nanogpt"), os.path.join(target, "zoo_nanogpt"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return os.path.join(target, "nanogpt.py")


def test_package_beside_model_file_missing_on_node_then_bundled(tmp_path):
    """The model file's folder is gone where it runs: the message names it and the fixes; --bundle fixes it."""
    source = str(tmp_path / "src")
    model = _copy_sources(source)
    out = str(tmp_path / "out")
    split_model(model, out, num_microbatches=2, layout=Layout(pp=2))
    os.rename(source, str(tmp_path / "moved"))  # the folder was copied to a node without the source tree
    result = torchrun(out, 2, "--steps", "1", timeout=120)
    assert result.returncode != 0
    assert (f"failed to import 'zoo_common' (ModuleNotFoundError: No module named 'zoo_common'); it was split with "
            f"{source!r}") in result.stderr
    assert "set PYTHONPATH" in result.stderr and "--bundle zoo_common" in result.stderr

    model = _copy_sources(str(tmp_path / "src2"))
    bundled = str(tmp_path / "bundled")
    command = [sys.executable, "-m", "tracepp", "split", model, "-o", bundled, "--ranks", "2", "--microbatches", "2",
               "--bundle", "zoo_common", "--bundle", "zoo_nanogpt"]
    split = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert split.returncode == 0, split.stderr
    assert os.path.isfile(os.path.join(bundled, "zoo_common.py"))
    assert os.path.isfile(os.path.join(bundled, "zoo_nanogpt", "model.py"))
    shutil.rmtree(str(tmp_path / "src2"))
    _train_and_compare(tmp_path, zoo_path("nanogpt"), bundled)


def test_bundle_of_unknown_package_names_the_fix(tmp_path):
    from tracepp.modelfile import ModelFileError, bundle_packages

    with pytest.raises(ModelFileError, match=r"--bundle nopkg: no package or module 'nopkg' in .*--bundle mypkg"):
        bundle_packages(str(tmp_path), ["nopkg"], [ZOO])


def test_zoo_model_that_cannot_be_traced_says_what_to_change(tmp_path, capsys):
    """T5 with the default use_cache=True returns a cache export cannot flatten: the user is told the fix."""
    from tracepp.cli import main

    source = open(zoo_path("t5")).read()
    assert source.count(', "use_cache": False}') == 1
    path = tmp_path / "t5_cache.py"
    path.write_text(source.replace(', "use_cache": False}', "}"))
    shutil.copyfile(os.path.join(ZOO, "zoo_common.py"), str(tmp_path / "zoo_common.py"))
    assert main(["check", str(path)]) == 2
    error = capsys.readouterr().err
    assert ("its output holds a transformers.cache_utils.EncoderDecoderCache, which torch.export cannot flatten"
            in error), error
    assert "pass use_cache=False, i.e. example_kwargs() returning {'use_cache': False}" in error, error
