"""nanoGPT-style plain PyTorch: the model lives in the package ``zoo_nanogpt`` beside this file."""
import torch
from zoo_common import causal_lm_loss, examples_of, sgd, token_batch
from zoo_nanogpt.model import GPT, GPTConfig

VOCAB = 64


def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB))


def batch(step):
    ids, target = token_batch(step, VOCAB)
    return (ids,), {}, target


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["transformer.h.1"]
