"""A tiny Hugging Face GPT2LMHeadModel built from a config (random weights, nothing downloaded).

GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``; dropout is off so the pipeline and eager
training compute the same thing. ``use_cache=False`` keeps the cache out of the output; the
``attention_mask`` keyword (left padding, different every step) is turned into the attention mask on stage 0.
"""
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 64, 32, 2, 2, 8, 4


def model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=2 * SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(config)


def _data(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    # left padding that differs per step and per row: the mask changes what attention reads
    padding = torch.randint(0, SEQ // 2, (BATCH,), generator=g)
    attention_mask = (torch.arange(SEQ).unsqueeze(0) >= padding.unsqueeze(1)).long()
    return tokens[:, :-1], {"attention_mask": attention_mask, "use_cache": False}, tokens[:, 1:]


def example_inputs():
    return (_data(0)[0],)


def example_kwargs():
    return _data(0)[1]


def example_target():
    return _data(0)[2]


def batch(step):
    idx, kwargs, target = _data(step)
    return (idx,), kwargs, target


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = ["transformer.h.1"]
