"""Issue 57: PEFT's VeRA as it computes (``peft/tuners/vera/layer.py``, ``Linear.forward``): one pair of frozen random
matrices ``vera_A [r, max in]`` and ``vera_B [max out, r]`` shared by every adapted layer, each layer slicing out
what its shape needs (``vera_A[:, :in_features]``, ``vera_B[:out_features, :]``) and training only two scaling
vectors: ``result + lambda_b * F.linear(lambda_d * F.linear(x, sliced_A), sliced_B)``; the base weights frozen.
lit-gpt's attention (4 query heads, 2 key/value heads) and SwiGLU otherwise, every projection adapted, hidden 64, 2
layers, 16 tokens, rank 8.

``--tp 2`` reads the frozen slices at each rank's piece: ``sliced_B``'s rows beside a column-wise projection (its
output added to the projection's sharded output), ``sliced_A``'s columns beside a row-wise one (partial sums of
the rank's features, all-reduced); ``lambda_b`` is sharded with the projection's output. Before, a linear whose
weight was not a parameter had no rule: the adapter's output was whole and the attention ran whole on every rank
(PEFT's VeRA on a Llama: 0.65 of each layer).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, FFN, Decoder, RMSNorm, SeparateAttention, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401

RANK, WIDEST = 8, max(D, FFN)


class VeRALinear(nn.Module):
    def __init__(self, base: nn.Linear, vera_A, vera_B):
        super().__init__()
        self.base_layer = base
        base.weight.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_buffer("vera_A", vera_A)
        self.register_buffer("vera_B", vera_B)
        self.vera_lambda_d = nn.Parameter(torch.full((RANK,), 0.1))
        self.vera_lambda_b = nn.Parameter(0.1 * torch.randn(self.out_features))  # (zeros in a fresh fine-tune)

    def forward(self, x):
        result = self.base_layer(x)
        sliced_A = self.vera_A[:, : self.in_features]
        sliced_B = self.vera_B[: self.out_features, :]
        return result + self.vera_lambda_b * F.linear(self.vera_lambda_d * F.linear(x, sliced_A), sliced_B)


def model():
    torch.manual_seed(0)
    decoder = Decoder(2, functools.partial(RMSNorm, D), lambda: SeparateAttention(2), SwiGLU)
    vera_A, vera_B = torch.randn(RANK, WIDEST) / WIDEST ** 0.5, torch.randn(WIDEST, RANK) / RANK ** 0.5
    for block in decoder.transformer.h:
        for owner, names in ((block.attn, ("to_q", "to_k", "to_v", "to_out")), (block.mlp, ("fc_1", "fc_2", "proj"))):
            for name in names:
                setattr(owner, name, VeRALinear(getattr(owner, name), vera_A, vera_B))
    for name, param in decoder.named_parameters():
        if "vera_lambda" not in name:
            param.requires_grad_(False)
    return decoder


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
