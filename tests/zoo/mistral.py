"""Mistral causal LM (tiny config, random weights, nothing downloaded)."""
import torch
from transformers import MistralConfig, MistralForCausalLM
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64


def model():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)
    return MistralForCausalLM(config)


def batch(step):
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["model.layers.1"]
