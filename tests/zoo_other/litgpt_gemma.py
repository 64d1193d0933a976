"""litgpt's Gemma (``litgpt.model.GPT`` with ``Config.from_name("gemma-2b")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: one key/value group (multi-query attention, as Gemma-2B), q/k/v in one fused ``qkv``
projection, a GeGLU MLP (``GemmaMLP``), RMSNorm with a unit offset, embeddings scaled by sqrt(hidden), a head of
its own (litgpt's ``GPT`` keeps ``lm_head`` apart from ``wte``); dim 64, 4 query heads of 16, 2 layers, vocabulary
128. ``LITGPT_CONFIG`` names another of litgpt's configs (``litgpt_llama.py`` sets it to a Llama 3).
"""
import os

from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GemmaMLP), litgpt/config.py"
NAME = os.environ.get("LITGPT_CONFIG", "gemma-2b")
GROUPS = {"gemma-2b": 1}.get(NAME, 2)
HEADS_, KV_HEADS_ = HEADS, GROUPS

model = builder(NAME, n_query_groups=GROUPS)
