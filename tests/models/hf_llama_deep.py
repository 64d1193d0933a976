"""A tiny Hugging Face Llama with 22 decoder layers (the depth of a 1.1B TinyLlama), LM head tied, and no split
points: ``tracepp split --stages N`` cuts it between ``model.layers.N`` by the cost model alone."""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 64, 16, 22, 2, 8, 4


def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=2 * SEQ, tie_word_embeddings=True, attention_dropout=0.0,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(config)


def _data(step):
    g = torch.Generator().manual_seed(500 + step)
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

