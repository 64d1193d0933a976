"""A decoder built as ``nn.Sequential`` (lucidrains' PaLM returns one: embedding, blocks, norm, head), so its one
input is ``Sequential.forward``'s ``input``: export names that placeholder ``input``, and a stage graph, where
``input`` would shadow the builtin, names it ``input_1``. GPT-2's block (``cp_learned_positions``' without learned
positions); 2 layers, hidden 64, 4 heads, 16 tokens.

``--cp 2`` must find the sequence length on the stage graph (it said the model "has no batched input of two or
more dims" because it looked the root input up by its whole-graph name).
"""
import torch
import torch.nn as nn
from cp_learned_positions import Block
from lib_style import D, VOCAB, loss_fn, sgd, token_batch  # noqa: F401  (the model file's loss_fn)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, D), Block(), Block(), nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False))


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
