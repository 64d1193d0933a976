"""Issue 57: activation checkpointing as gateloop-transformer and many training scripts turn it on by default,
``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)``: torch's ``CheckpointFunction``, an
``autograd.Function`` whose forward runs ``fn`` under ``torch.no_grad()`` and whose backward runs it again with
gradients on. torch.export keeps the forward only: split, nothing before it trained (refused). Its backward is
checked against autograd's derivative of its forward, and the forward traced again with ``fn`` recorded
(``tracepp/custom_functions.py``); ``--checkpoint`` recomputes it, if the memory is wanted back.
"""
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, BATCH, SEQ = 32, 16, 4, 8


class CheckpointedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        return x + checkpoint(self.mlp, self.norm(x), use_reentrant=True)


model = model_of(VOCAB, D, CheckpointedMLP)
batch = token_batch(VOCAB, BATCH, SEQ, 1900)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
