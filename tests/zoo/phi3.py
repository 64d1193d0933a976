"""Phi-3 causal LM (tiny config, random weights, nothing downloaded)."""
import torch
from transformers import Phi3Config, Phi3ForCausalLM
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64


def model():
    torch.manual_seed(0)
    config = Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    return Phi3ForCausalLM(config)


def batch(step):
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["model.layers.1"]
