"""Transformers' causal-LM families, a rotating few per run (issue 47), tier 3: torchrun on gloo against eager.

The whole list is measured by the study ``benchmarks/studies/families.py`` (``docs/families.md``): every family
transformers ships, at a tiny config built from its own config class (``tests/zoo/hf_family.py``). Here each run
trains two of them, drawn by a seed that changes every day (``TRACEPP_FAMILY_SEED`` sets it; it is in the test
id): a dense family at ``--tp 2`` (two stages on one pipeline rank, microbatch size 1), whose decoder layers must
shard at least the share the table gives, and a mixture-of-experts family at ``--dp 2 --ep 2``. Both train 3 SGD
steps equal to eager within 2e-5. The pools are the families the table shows exact.
"""
import datetime
import os
import random
import sys

import pytest
import torch

from tracepp.driver import split_model
from tracepp.runtime.mesh import Layout
from util import REPO, assert_state_close, assert_trained, eager_train, torchrun

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zoo", "hf_family.py")
SEED = int(os.environ.get("TRACEPP_FAMILY_SEED", datetime.date.today().strftime("%Y%m%d")))
# family -> the smallest share of a decoder layer's parameters --tp 2 shards (docs/families.md)
DENSE = {"llama": 0.99, "apertus": 0.99, "arcee": 0.99, "bloom": 0.99, "cohere": 0.99, "stablelm": 0.99,
         "gpt_bigcode": 0.84, "doge": 0.99, "gemma4_text": 0.99, "lfm2": 0.99, "deepseek_v3": 0.99,
         "llama4_text": 0.99, "recurrent_gemma": 0.98, "cpmant": 0.99, "moshi": 0.99, "olmo_hybrid": 0.98,
         "qwen3_5_text": 0.98, "xlm": 0.99, "jamba": 0.99, "zaya": 0.98, "inkling_text": 0.95, "falcon_mamba": 0.99,
         "deepseek_v32": 0.93}
MOE = ["gpt_oss", "afmoe", "aria_text", "phimoe", "nemotron_h"]


def _draw():
    rng = random.Random(SEED)
    return rng.choice(sorted(DENSE)), rng.choice(sorted(MOE))


DENSE_FAMILY, MOE_FAMILY = _draw()


def _train(out: str, nproc: int, family: str, tmp_path) -> None:
    ckpt = str(tmp_path / "trained.pt")
    result = torchrun(out, nproc, "--steps", "3", "--save", ckpt, "--quiet", env_extra={"HF_FAMILY": family})
    assert result.returncode == 0, f"{family}: torchrun failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    saved = torch.load(ckpt)
    assert_trained(saved, PATH)
    assert_state_close(saved, eager_train(PATH, 3))


@pytest.mark.parametrize("family", [pytest.param(DENSE_FAMILY, id=f"{DENSE_FAMILY}-seed{SEED}")])
def test_a_dense_family_shards_its_layers_at_tp2_and_trains_equal_to_eager(tmp_path, monkeypatch, family):
    sys.path.insert(0, REPO)
    from benchmarks.studies.families import layer_shares

    monkeypatch.setenv("HF_FAMILY", family)
    out = str(tmp_path / "out")
    manifest = split_model(PATH, out, schedule="looped-bfs", num_microbatches=4, layout=Layout(pp=1, tp=2))
    sys.path.insert(0, os.path.dirname(PATH))
    import hf_family

    shares = layer_shares(manifest, hf_family.model_class(family)(hf_family.config(family)))
    assert shares and min(shares.values()) >= DENSE[family], (shares, manifest["tp"]["stages"][0]["replicated"])
    _train(out, 2, family, tmp_path)


@pytest.mark.parametrize("family", [pytest.param(MOE_FAMILY, id=f"{MOE_FAMILY}-seed{SEED}")])
def test_a_moe_family_trains_at_ep2_equal_to_eager(tmp_path, monkeypatch, family):
    monkeypatch.setenv("HF_FAMILY", family)
    out = str(tmp_path / "out")
    manifest = split_model(PATH, out, num_microbatches=2, layout=Layout(pp=1, dp=2, ep=2))
    assert manifest["ep"]["params"] and not any(block.get("refused") for block in manifest["ep"]["blocks"])
    _train(out, 2, family, tmp_path)
