"""A decoder as TransformerLens writes its ``HookedTransformer`` (``transformer_lens/components``), parameters held in
the shapes the library reads them in and reshaped at every call:

* the embedding is the table indexed by the tokens, ``W_E[tokens, :]`` (``aten.index``, not ``aten.embedding``),
  the learned positions ``W_pos[:seq, :]``;
* q, k and v weights are 3-D, ``[heads, d_model, d_head]``, each rearranged on every call to
  ``[(heads d_head), d_model]`` (``permute`` then ``reshape``) for ``F.linear``; ``W_O`` ``[heads, d_head, d_model]``
  to ``[d_model, (heads d_head)]``;
* the MLP and the unembedding read ``W.T.contiguous()`` of ``[d_in, d_out]`` weights;
* a pre-norm LayerNorm written out (TransformerLens's ``LayerNorm``: centre, scale by the root mean square).

``TL_LAYOUT=linear`` keeps the same maths with weights in the shapes ``F.linear`` reads (q, k, v ``[heads * d_head,
d_model]``, ``W_O`` ``[d_model, heads * d_head]``, the MLP's ``W.T`` without the copy): what the rearranged model
should shard as.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import loss_fn, sgd, token_batch  # noqa: F401  (the model file's loss_fn)

VOCAB, D, HEADS, D_HEAD, D_MLP, LAYERS, N_CTX = 128, 64, 4, 16, 128, 2, 64  # a batch of 4 x 16 tokens (lib_style)
LAYOUT = os.environ.get("TL_LAYOUT", "hooked")


def _randn(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.1)


class LayerNorm(nn.Module):
    def __init__(self, length):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(length)), nn.Parameter(torch.zeros(length))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        scale = (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        return x / scale * self.w + self.b


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        if LAYOUT == "hooked":
            self.W_Q, self.W_K, self.W_V = (_randn(HEADS, D, D_HEAD) for _ in range(3))
            self.W_O = _randn(HEADS, D_HEAD, D)
        else:
            self.W_Q, self.W_K, self.W_V = (_randn(HEADS * D_HEAD, D) for _ in range(3))
            self.W_O = _randn(D, HEADS * D_HEAD)
        self.b_Q, self.b_K, self.b_V = (nn.Parameter(torch.zeros(HEADS, D_HEAD)) for _ in range(3))
        self.b_O = nn.Parameter(torch.zeros(D))

    @staticmethod
    def _project(x, w, b):  # transformer_lens/utilities/attention.py: simple_attn_linear
        if LAYOUT == "hooked":
            w = w.permute(0, 2, 1).reshape(-1, D)  # "head d_model d_head -> (head d_head) d_model"
        out = F.linear(x, w, b.reshape(-1))
        return out.reshape(x.shape[0], x.shape[1], HEADS, D_HEAD)

    def forward(self, x):
        q, k, v = (self._project(x, w, b) for w, b in ((self.W_Q, self.b_Q), (self.W_K, self.b_K),
                                                          (self.W_V, self.b_V)))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D_HEAD ** 0.5
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        pattern = scores.masked_fill(mask, float("-inf")).softmax(-1)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        w = self.W_O
        if LAYOUT == "hooked":
            w = w.permute(2, 0, 1).reshape(D, -1).contiguous()  # "head d_head d_model -> d_model (head d_head)"
        return F.linear(z.reshape(z.shape[0], z.shape[1], -1), w, self.b_O)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.W_in, self.W_out = _randn(D, D_MLP), _randn(D_MLP, D)
        self.b_in, self.b_out = nn.Parameter(torch.zeros(D_MLP)), nn.Parameter(torch.zeros(D))

    def forward(self, x):
        if LAYOUT == "hooked":
            return F.linear(F.gelu(F.linear(x, self.W_in.T.contiguous(), self.b_in)), self.W_out.T.contiguous(),
                            self.b_out)
        return F.linear(F.gelu(F.linear(x, self.W_in.T, self.b_in)), self.W_out.T, self.b_out)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = LayerNorm(D), Attention(), LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HookedTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.W_E, self.W_pos = _randn(VOCAB, D), _randn(N_CTX, D)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_final = LayerNorm(D)
        self.W_U, self.b_U = _randn(D, VOCAB), nn.Parameter(torch.zeros(VOCAB))

    def forward(self, tokens):
        x = self.W_E[tokens, :] + self.W_pos[:tokens.shape[1], :]
        for block in self.blocks:
            x = block(x)
        w = self.W_U.T.contiguous() if LAYOUT == "hooked" else self.W_U.T
        return F.linear(self.ln_final(x), w, self.b_U)


def model():
    torch.manual_seed(0)
    return HookedTransformer()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
