"""GPT-2 written `import transformers as tf` (its output class lives in a lazily imported module).

Tiny config, random weights, nothing downloaded.
"""
import torch
import transformers as tf
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64


def model():
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return tf.GPT2LMHeadModel(config)


def batch(step):
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = ["transformer.h.1"]
