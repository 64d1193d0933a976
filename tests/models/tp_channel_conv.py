"""Issue 57: a convolution over the channels of a sharded projection, as convolutional mixers write one (a Conv1d of
groups 1 mixing every channel with its neighbours in time, H3's and Hyena's short filters before they became
depthwise): a column-wise projection into ``2 * D`` channels, ``F.pad`` of the time dim for causality, a ``Conv1d(2 *
D, D, KERNEL)`` with a bias (``CONV_BIAS=0``: without), a residual add.

A convolution over channels is a sum over them, whatever its kernel: with its input sharded on the channels, each
rank's product is a partial sum of every output channel, all-reduced, its bias added once after the sum (along the
channels). Before, only a kernel of 1 without a bias was read so, and a wider one kept the projection before it whole.
"""
import os

import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, KERNEL, BATCH, SEQ = 32, 16, int(os.environ.get("CONV_KERNEL", "3")), 4, 8
BIAS = os.environ.get("CONV_BIAS", "1") == "1"


class ChannelConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 2 * D)
        self.conv = nn.Conv1d(2 * D, D, KERNEL, bias=BIAS)

    def forward(self, x):
        h = F.pad(F.silu(self.proj(x)).transpose(1, 2), (KERNEL - 1, 0))  # causal: pad the time dim only
        return x + self.conv(h).transpose(1, 2)


model = model_of(VOCAB, D, ChannelConv)
batch = token_batch(VOCAB, BATCH, SEQ, 1700)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
