"""Qwen3-MoE causal LM (tiny config: 8 experts, top-2, every layer sparse; random weights, nothing downloaded)."""
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64


def model():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(config)


def batch(step):
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["model.layers.1"]
