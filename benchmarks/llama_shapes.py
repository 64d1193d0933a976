"""A Hugging Face ``LlamaForCausalLM`` of a real size, built from a config (nothing downloaded), as a model file.

The size comes from the environment, so one file serves every case of ``benchmarks/real_size.py``:
``TRACEPP_LLAMA=7b`` (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000), ``70b`` (hidden
8192, 80 layers, 64 heads, 8 kv heads, intermediate 28672, vocab 32000), ``405b`` (Llama 3 405B: hidden 16384,
126 layers, 128 heads, 8 kv heads, intermediate 53248, vocab 128256) or ``500m`` (hidden 1536, 16 layers,
12 heads, intermediate 4096, vocab 32000: 551M parameters, small enough to train on a CPU machine), or ``tiny``
(hidden 64, 4 layers: the same architecture with negligible tensors, for the memory baseline of a training rank).
"""
import os

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672),
    # Llama 3 405B (hidden 16384, 126 layers, 128 heads, 8 key/value heads, FFN 53248, vocabulary 128256)
    "405b": dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
                 intermediate_size=53248, vocab_size=128256),
    "500m": dict(hidden_size=1536, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=4096),
    # the same architecture with negligible tensors: what a training rank holds besides them (torch's baseline)
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128),
}
SHAPE = os.environ.get("TRACEPP_LLAMA", "7b")
VOCAB = SHAPES[SHAPE].get("vocab_size", 32000)
BATCH = int(os.environ.get("TRACEPP_LLAMA_BATCH", "4"))
SEQ = int(os.environ.get("TRACEPP_LLAMA_SEQ", "128"))


def model():
    torch.manual_seed(0)
    shape = {key: value for key, value in SHAPES[SHAPE].items() if key != "vocab_size"}
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=max(4096, SEQ), tie_word_embeddings=False,
                         attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=None, **shape)
    return LlamaForCausalLM(config)


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


def batch(step):
    idx, target = _data(step)
    return (idx,), {"use_cache": False}, target


def loss_fn(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
