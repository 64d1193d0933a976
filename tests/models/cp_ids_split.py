"""Token ids cut into segments before any embedding reads them, as infini-transformer-pytorch's wrapper runs its
model (``InfiniTransformerWrapper.forward``: ``seq.split(segment_length)``, one call per segment): ``--cp`` finds no
sequence shard to start from, and says which op reads the ids instead (``split`` and its line). A lit-gpt decoder
run on two segments of 8 tokens (hidden 64, 2 layers), the logits joined again.
"""
import functools

import torch
from lib_style import D, Decoder, GroupedFusedAttention, RMSNorm, SwiGLU, loss_fn, sgd, token_batch  # noqa: F401


class Segments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = Decoder(2, functools.partial(RMSNorm, D), functools.partial(GroupedFusedAttention, 2), SwiGLU)

    def forward(self, ids):
        return torch.cat([self.decoder(segment) for segment in ids.split(8, dim=1)], dim=1)


def model():
    torch.manual_seed(0)
    return Segments()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
