"""Hugging Face Qwen3 and Mixtral at tensor-parallel shapes: 4 query heads and 2 key/value heads, so ``--tp 2``
shards their attention (the zoo's tiny configs have one key/value head, which tp 2 cannot split: their
attention is replicated). ``TP_HF_FAMILY`` picks the family (``qwen3`` default, ``mixtral``); random weights,
nothing downloaded. Mixtral's experts are replicated: only attention, the embedding and the head shard.
SGD, as the rest of the zoo: AdamW divides each gradient by its own running size, so an expert that saw no
token in a step (gradient ~1e-12 of rounding) would move by lr whatever the rounding was.
"""
import os

import torch
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64
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
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["model.layers.1"]
