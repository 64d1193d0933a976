"""A Hugging Face LlamaForCausalLM for the tensor-parallel step benchmark (``python -m benchmarks.tensor_parallel
step``): built from a config (random weights, nothing downloaded), untied head, grouped-query attention.

Size: hidden 256, 8 query heads and 4 key/value heads of 32, SwiGLU 768, 4 layers, vocabulary 4096 (5.3M
parameters); a batch of 4 x 128 tokens. ``HF_LLAMA_BENCH_SIZE=tiny`` shrinks it for the test of the harness.
Both systems of the benchmark import this file: tracepp splits it, the torch worker calls ``model()`` and
``batch(step)`` and applies ``parallelize_module`` to the module it returns.
"""
import os

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

if os.environ.get("HF_LLAMA_BENCH_SIZE") == "tiny":
    VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, BATCH, SEQ = 128, 32, 64, 4, 4, 2, 4, 16
else:
    VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, BATCH, SEQ = 4096, 256, 768, 4, 8, 4, 4, 128


def config():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=SEQ, tie_word_embeddings=False, attention_dropout=0.0,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None)


def model():
    torch.manual_seed(0)
    built = LlamaForCausalLM(config())
    built.config._attn_implementation = "sdpa"
    return built


def batch(step):
    generator = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return (tokens[:, :-1],), {"use_cache": False}, tokens[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return batch(0)[1]


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)
