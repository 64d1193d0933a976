"""litgpt's ``GPT`` (``litgpt/model.py``) built from one of its named configs (``litgpt/config.py``,
``Config.from_name``) at the second table's tiny size (``other_common``: hidden 64, 4 query heads of 16, 2 layers,
an MLP of 128, a vocabulary of 128), and the model-file contract every ``litgpt_*.py`` file here shares: a batch of
token ids, next-token cross-entropy, SGD. A model file names its config and what it changes beyond the size.
"""
import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)
from litgpt.config import Config
from litgpt.model import GPT

LIBRARY, VERSION = "litgpt", version("litgpt")


def tiny_config(name: str, **changes) -> Config:
    """litgpt's config ``name`` at the tiny size, with ``changes`` (key/value groups, a window, experts) on top."""
    sizes = dict(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, head_size=HEAD_DIM, intermediate_size=FFN,
                 vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=SEQ * 8)
    return Config.from_name(name, **dict(sizes, **changes))


def builder(name: str, **changes):
    """A model file's ``model()``: litgpt's ``GPT`` of :func:`tiny_config`, its own initialisation, seed 0."""
    def model():
        torch.manual_seed(0)
        return GPT(tiny_config(name, **changes))
    return model


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
