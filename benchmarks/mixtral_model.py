"""A small Mixtral (8 experts, top-2, hidden 128, 8 layers, vocabulary 256) as a model file for
``benchmarks/moe_plan.py mixtral``: big enough that the experts' grouped matmuls dominate a CPU step."""
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB, BATCH, SEQ = 256, 8, 64


def model():
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                           num_local_experts=8, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


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
