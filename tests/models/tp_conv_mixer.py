"""A short-convolution mixer for tensor parallelism, as hybrid families write one: a column-parallel projection
into heads of channels, ``F.pad`` of the time dim, a grouped causal convolution with one group per head (ZAYA's
query/key convolution), ``torch.concatenate`` of two branches along the channels (xLSTM's spelling of ``cat``), and
a row-parallel projection back. Every op keeps the channels of a head together: each rank runs its heads.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, HEADS, KERNEL, BATCH, SEQ = 32, 16, 4, 3, 4, 8


class ConvMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 2 * D)
        self.conv = nn.Conv1d(D, D, KERNEL, groups=HEADS)  # 4 channels a group: one group per head
        self.out = nn.Linear(2 * D, D)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        a = F.pad(a.transpose(1, 2), (KERNEL - 1, 0))  # causal: pad the time dim only
        a = self.conv(a).transpose(1, 2)
        mixed = torch.concatenate([torch.tanh(a), F.silu(b)], dim=-1)
        return x + self.out(mixed)


model = model_of(VOCAB, D, ConvMixer)
batch = token_batch(VOCAB, BATCH, SEQ, 1100)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
