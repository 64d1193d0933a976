"""litgpt's Gemma (``litgpt.model.GPT`` with ``Config.from_name("gemma-2b")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: one key/value group (multi-query attention, as Gemma-2B), q/k/v in one fused ``qkv``
projection, a GeGLU MLP (``GemmaMLP``), RMSNorm with a unit offset, embeddings scaled by sqrt(hidden), a head tied to
the embedding; dim 64, 4 query heads of 16, 2 layers, vocabulary 128. ``LITGPT_CONFIG`` names another of litgpt's
configs (``litgpt_llama.py`` sets it to a Llama 3).
"""
import os

import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)
from litgpt.config import Config
from litgpt.model import GPT

LIBRARY, VERSION = "litgpt", version("litgpt")
SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GemmaMLP), litgpt/config.py"
NAME = os.environ.get("LITGPT_CONFIG", "gemma-2b")
GROUPS = {"gemma-2b": 1}.get(NAME, 2)
HEADS_, KV_HEADS_ = HEADS, GROUPS


def config():
    return Config.from_name(NAME, n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_query_groups=GROUPS,
                            head_size=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                            block_size=SEQ * 8)


def model():
    torch.manual_seed(0)
    return GPT(config())


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
