"""Issue 57: hyper-connections (Zhu et al. 2024; lucidrains' ``hyper-connections``, which local-attention and
x-transformers use): 4 residual streams folded into the batch (``[4 b, s, h]``), each branch reading a mix of them
weighted per position (``width_connection``: the streams normed, ``tanh(normed @ dynamic_alpha_fn)`` scaled and
added to a static mix, an einsum over the streams) and its output added back to each stream weighted
(``depth_connection``: ``tanh(normed @ dynamic_beta_fn)``); the attention and the MLP are lit-gpt's; hidden 64,
4 heads, 16 tokens, 2 layers.

``inspect``'s Megatron figure per layer is the two all-reduces of the branch's ``[b, s, h]``, not of the 4 streams'
``[4 b, s, h]`` (0.32x had been printed for local-attention), and the mixing weights' ``normed @ dynamic_alpha_fn``
(64 -> 5) is not an MLA latent.
"""
import torch
import torch.nn as nn
from lib_style import D, VOCAB, RMSNorm, SeparateAttention, SwiGLU, loss_fn, rope_cache, sgd, token_batch  # noqa: F401 (loss_fn: the contract)

STREAMS = 4


class HyperConnection(nn.Module):
    """One branch (attention or MLP) between residual streams: hyper_connections.py's ``HyperConnections``."""

    def __init__(self, index, branch):
        super().__init__()
        self.norm, self.branch = RMSNorm(D), branch
        alpha0 = torch.zeros(STREAMS, 1)
        alpha0[index % STREAMS, 0] = 1.0
        self.static_alpha = nn.Parameter(torch.cat((alpha0, torch.eye(STREAMS)), dim=1))
        self.dynamic_alpha_fn = nn.Parameter(0.02 * torch.randn(D, STREAMS + 1))
        self.dynamic_alpha_scale = nn.Parameter(torch.ones(()) * 1e-2)
        self.static_beta = nn.Parameter(torch.ones(STREAMS))
        self.dynamic_beta_fn = nn.Parameter(0.02 * torch.randn(D))
        self.dynamic_beta_scale = nn.Parameter(torch.ones(()) * 1e-2)

    def forward(self, residuals, *args):
        b = residuals.shape[0] // STREAMS
        residuals = residuals.view(b, STREAMS, *residuals.shape[1:]).permute(0, 2, 1, 3)  # (b s) n d -> b n s d
        normed = self.norm(residuals)
        alpha = torch.tanh(normed @ self.dynamic_alpha_fn) * self.dynamic_alpha_scale + self.static_alpha
        beta = torch.tanh(normed @ self.dynamic_beta_fn) * self.dynamic_beta_scale + self.static_beta
        mix = torch.einsum("bnst,bnsd->bntd", alpha, residuals)
        branch_input, residuals = mix[..., 0, :], mix[..., 1:, :]
        out = self.branch(branch_input, *args)
        residuals = residuals + out[..., None, :] * beta[..., None]
        return residuals.permute(0, 2, 1, 3).reshape(b * STREAMS, *residuals.shape[1:2], D)


class Block(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.attn = HyperConnection(2 * index, SeparateAttention(2))
        self.mlp = HyperConnection(2 * index + 1, SwiGLU())

    def forward(self, x, cos, sin):
        return self.mlp(self.attn(x, cos, sin))


class HyperDecoder(nn.Module):
    """lib_style's ``Decoder`` (lit-gpt's names) with the streams made from the embedding and summed before the
    final norm."""

    def __init__(self, layers):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, D),
                                          "h": nn.ModuleList([Block(i) for i in range(layers)]), "ln_f": RMSNorm(D)})
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        cos, sin = rope_cache(idx.shape[1])
        x = self.transformer.wte(idx).repeat_interleave(STREAMS, dim=0)  # the streams, folded into the batch
        for block in self.transformer.h:
            x = block(x, cos, sin)
        x = x.view(-1, STREAMS, *x.shape[1:]).sum(dim=1)
        return self.lm_head(self.transformer.ln_f(x))


def model():
    torch.manual_seed(0)
    return HyperDecoder(2)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
