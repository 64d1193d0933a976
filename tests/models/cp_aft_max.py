"""An Attention Free Transformer layer (Zhai et al. 2021, AFT-simple) as labml-nn and the paper's code write it: each
position's output is ``sigmoid(q) * sum_t(exp(k_t - max_k) * v_t) / sum_t(exp(k_t - max_k))``, the keys' maximum over
the sequence taken first so that ``exp`` cannot overflow (labml's ``key.max(dim=0, keepdims=True)[0]``,
``aft/__init__.py:202``; Performer's ``amax`` of its keys is the same kind of stabiliser). Under ``--cp`` the sums over
the sequence are each rank's partial sums, all-reduced, and the maximum each rank's, all-reduced with max
(``cp_amax``); ``--cp`` refused it before ("a max.dim over the sequence dim leaves each rank a partial max").

The first layer takes the maximum with ``max(dim).values``, the second with ``amax`` and keeps Performer's ``+ eps``
beside the stabilised ``exp`` (its ``softmax_kernel``), so that its maximum does not cancel from the output; ``AFT_INDEX=1`` also reads the
index of the first one's maximum, which no rank can give alone: refused by name. Lit-gpt's decoder around it
(``lib_style.Decoder``: pre-norm blocks, a SwiGLU MLP); hidden 64, 2 layers, 16 tokens, a batch of 4.
"""
import functools
import os

import torch
import torch.nn as nn
from lib_style import D, Decoder, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

INDEX = os.environ.get("AFT_INDEX") == "1"


class AFTSimple(nn.Module):
    layers = 0

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.output = nn.Linear(D, D)
        self.use_amax = AFTSimple.layers % 2 == 1
        AFTSimple.layers += 1

    def forward(self, x, cos=None, sin=None):  # [batch, seq, d]; no positions
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.use_amax:
            max_key = k.amax(dim=1, keepdim=True)
        else:
            max_key, at = k.max(dim=1, keepdim=True)
            if INDEX:
                q = q + at.to(q.dtype) * 0.01
        exp_key = torch.exp(k - max_key)
        if self.use_amax:  # Performer's features keep an eps beside the stabilised exp: the maximum does not cancel
            exp_key = exp_key + 1e-4
        weighted = (exp_key * v).sum(dim=1, keepdim=True) / exp_key.sum(dim=1, keepdim=True)
        return self.output(torch.sigmoid(q) * weighted)


def model():
    torch.manual_seed(0)
    AFTSimple.layers = 0
    return Decoder(2, functools.partial(nn.LayerNorm, D), AFTSimple, SwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
