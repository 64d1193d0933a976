"""Gemma2 causal LM: tied embeddings, logit soft-capping, sliding window (tiny config, nothing downloaded)."""
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64


def model():
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, head_dim=16, sliding_window=4,
        attn_implementation="eager")
    return Gemma2ForCausalLM(config)


def batch(step):
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["model.layers.1"]
