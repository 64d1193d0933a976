"""Hugging Face Qwen3 and Mixtral at tensor-parallel shapes: 4 query heads and 2 key/value heads, so ``--tp 2``
shards their attention (the zoo's tiny configs have one key/value head, which tp 2 cannot split: their
attention is replicated). ``TP_HF_FAMILY`` picks the family (``qwen3`` default, ``mixtral``); random weights,
nothing downloaded. Mixtral's experts are replicated: only attention, the embedding and the head shard.
"""
import os

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 64, 8, 4
FAMILY = os.environ.get("TP_HF_FAMILY", "qwen3")


def model():
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, head_dim=8)
    if FAMILY == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**common))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
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
    # SGD as the zoo: AdamW divides each gradient by its own running size, so an expert that saw no token in a
    # step (gradient ~1e-12 of rounding) moves by lr whatever the rounding was; SGD keeps the comparison fair
    return torch.optim.SGD(params, lr=0.1)


split_points = ["model.layers.1"]
