"""Pieces of a decoder as xLSTM writes its mLSTM layer (``xlstm/components/linear_headwise.py``, ``ln.py``):

* ``LinearHeadwiseExpand``: a block-diagonal projection, one ``[out, in]`` block per head, ``x.view(..., heads, -1)``
  then ``torch.einsum("...hd,hod->...ho", x, weight)`` (an ellipsis over the batch and sequence dims);
* ``MultiHeadLayerNorm``: each head's features normalised on their own, ``F.group_norm`` of
  ``[batch * seq, heads * d]`` with one group a head, its weight a proxy ``1.0 + weight`` (a residual weight);
* around them, causal attention over the heads and an up- and down-projection (``proj_up``, ``proj_down``).

Under ``--tp 2`` the einsum with an ellipsis had no labels (its input was gathered, the headwise weights whole) and
``group_norm`` had no rule (gathered): xLSTM's mLSTM layer sharded 0.84 of itself. Now the headwise weights are held
by their heads and the group norm runs on this rank's groups (``groups / tp``), its weight proxy made on the piece.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import loss_fn, sgd, token_batch  # noqa: F401  (the model file's loss_fn)

VOCAB, D, HEADS, LAYERS = 128, 64, 4, 2  # a batch of 4 x 16 tokens (lib_style.token_batch)
INNER = 2 * D  # proj_up's width, heads of INNER // HEADS


class LinearHeadwiseExpand(nn.Module):
    def __init__(self, features, heads):
        super().__init__()
        self.heads = heads
        self.weight = nn.Parameter(torch.randn(heads, features // heads, features // heads) * 0.2)

    def forward(self, x):
        shape = x.shape
        x = x.view(*shape[:-1], self.heads, -1)
        x = torch.einsum("...hd,hod->...ho", x, self.weight)
        return x.reshape(*shape[:-1], -1)


class MultiHeadLayerNorm(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(features))  # a residual weight: the norm scales by 1 + it

    def forward(self, x):  # [B, NH, S, DH]
        b, nh, s, dh = x.shape
        out = F.group_norm(x.transpose(1, 2).reshape(b * s, nh * dh), num_groups=nh, weight=1.0 + self.weight,
                           eps=1e-5)
        return out.view(b, s, nh, dh).transpose(1, 2)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj_up = nn.Linear(D, INNER, bias=False)
        self.q_proj, self.k_proj, self.v_proj = (LinearHeadwiseExpand(INNER, HEADS) for _ in range(3))
        self.outnorm = MultiHeadLayerNorm(INNER)
        self.proj_down = nn.Linear(INNER, D, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.proj_up(self.norm(x))
        q, k, v = (p(h).view(b, s, HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.outnorm(y).transpose(1, 2).reshape(b, s, INNER)
        return x + self.proj_down(y)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Model()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
