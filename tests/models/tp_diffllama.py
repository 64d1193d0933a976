"""A tiny Hugging Face DiffLlamaForCausalLM (differential attention: each head's values and output chunked into two
halves) with 8 query heads over 4 key/value heads, enough that each half of the heads splits over 2 ranks. Random
weights, nothing downloaded."""
import os

import torch
import torch.nn.functional as F
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 64, 64, 2, 8, 4
HEADS, KV_HEADS = int(os.environ.get("DIFF_HEADS", 8)), int(os.environ.get("DIFF_KV_HEADS", 4))


def model():
    torch.manual_seed(0)
    config = DiffLlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             head_dim=HIDDEN // HEADS, max_position_embeddings=2 * SEQ, attention_dropout=0.0,
                             bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return DiffLlamaForCausalLM(config)


def _data(step):
    g = torch.Generator().manual_seed(400 + step)
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
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = ["model.layers.1"]
