"""Running sums along the sequence, as two libraries write them, between attention layers:

* minGRU (lucidrains' ``minGRU-pytorch``, ``minGRU.py``; Feng et al. 2024, "Were RNNs All We Needed?"): the gated
  recurrence ``h_t = (1 - z_t) h_{t-1} + z_t h~_t`` computed in parallel in log space by Heinsen's scan,
  ``a* = cumsum(log a)``, ``log h = a* + logcumsumexp(log b - a*)``; then ``out[:, -seq_len:]`` (the whole sequence:
  refused before as "takes part of the sequence dim") and ``out[:, -1:]``, the next hidden state, which nothing reads
  in training (refused before; now dropped from the rank's program);
* x-transformers' data-dependent ALiBi: the forget gates' running sums, their differences for every (query, key)
  pair added to the attention scores (the keys' sums all-gathered, as attention's keys are);
* token-shift-gpt's cumulative mean (``token_shift_gpt.py:83``): each position's mean of the features of every
  position up to it, ``x.cumsum(dim=1) / arange(1, n + 1)``, in front of each feed-forward.

Under ``--cp`` each chunk's running values are its own plus the totals of every chunk before it (``cp_cumsum``,
``cp_logcumsumexp``: the chunks' totals all-gathered); ``--cp`` refused both before ("a cumulative sum along the
sequence dim"). Lit-gpt's decoder around them (``lib_style.Decoder``, attention in odd layers); hidden 64, 16 tokens,
a batch of 4.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, HEAD_DIM, HEADS, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401,E501


def heinsen_associative_scan_log(log_coeffs, log_values):
    a_star = log_coeffs.cumsum(dim=1)
    log_h0_plus_b_star = (log_values - a_star).logcumsumexp(dim=1)
    return (a_star + log_h0_plus_b_star).exp()


def log_g(x):
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


class MinGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_hidden_and_gate = nn.Linear(D, 2 * D, bias=False)
        self.to_out = nn.Linear(D, D, bias=False)

    def forward(self, x, cos=None, sin=None):
        seq_len = x.shape[1]
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        log_coeffs = -F.softplus(gate)
        log_values = -F.softplus(-gate) + log_g(hidden)
        out = heinsen_associative_scan_log(log_coeffs, log_values)
        out = out[:, -seq_len:]  # minGRU's, after an optional previous hidden state: the whole sequence here
        next_prev_hidden = out[:, -1:]  # noqa: F841  (minGRU's return_next_prev_hidden: unread when training)
        return self.to_out(out)


class DataDependentAlibiAttention(SeparateAttention):
    """x-transformers' ``data_dependent_alibi`` (``x_transformers.py:733``, from Forgetting Transformer): a forget gate
    per head and position, log-sigmoid, summed along the sequence; the bias of query i for key j is the sum of the
    gates between them, ``einx.subtract('b h i, b h j -> b h i j', g, g)``, added to the ``einsum`` scores."""

    def __init__(self):
        super().__init__(2)
        self.to_forget_gates = nn.Linear(D, HEADS)

    def heads(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.tiled(x)
        gates = F.logsigmoid(self.to_forget_gates(x)).transpose(1, 2).cumsum(dim=-1)  # [b, h, n]
        bias = gates[..., :, None] - gates[..., None, :]
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HEAD_DIM ** -0.5 + bias
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(causal, -torch.finfo(sim.dtype).max).softmax(dim=-1)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


class Mixer(nn.Module):
    """minGRU in even layers, attention with a data-dependent ALiBi in odd ones."""
    layers = 0

    def __init__(self):
        super().__init__()
        self.mix = MinGRU() if Mixer.layers % 2 == 0 else DataDependentAlibiAttention()
        Mixer.layers += 1

    def forward(self, x, cos, sin):
        return self.mix(x, cos, sin)


class CumulativeMeanSwiGLU(SwiGLU):
    """token-shift-gpt's running mean of the features, added to the feed-forward's input."""

    def forward(self, x):
        n = x.shape[1]
        running = x.cumsum(dim=1) / torch.arange(1, n + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)
        return super().forward(x + running)


def model():
    torch.manual_seed(0)
    Mixer.layers = 0
    return Decoder(2, functools.partial(RMSNorm, D), Mixer, CumulativeMeanSwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
