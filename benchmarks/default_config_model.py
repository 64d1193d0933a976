"""A transformers causal LM at its config class's default size (``LlamaConfig()`` is Llama 2 7B, ``Gemma4TextConfig()``
a 2,304-wide, 30-layer Gemma 4), built from the config alone (nothing downloaded), as a model file: tracepp plans it
on meta tensors. ``TRACEPP_DEFAULT_FAMILY``: the model type (``llama``, ``gemma2``, ``gemma4_text``, ...);
``TRACEPP_DEFAULT_SEQ``: the sequence length (2,048)."""
import os

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

FAMILY = os.environ.get("TRACEPP_DEFAULT_FAMILY", "llama")
BATCH, SEQ = 4, int(os.environ.get("TRACEPP_DEFAULT_SEQ", "2048"))
CONFIG = AutoConfig.for_model(FAMILY, max_position_embeddings=max(SEQ, 4096))
VOCAB = CONFIG.vocab_size


def model():
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(CONFIG)
    if hasattr(built, "set_default_language"):  # X-MOD's adapters are per language: its first one
        built.set_default_language(CONFIG.languages[0])
    return built


def _data(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def example_inputs():
    return (_data(0)[0],)


def example_kwargs():
    return {"use_cache": False}


def example_target():
    return _data(0)[1]


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))
