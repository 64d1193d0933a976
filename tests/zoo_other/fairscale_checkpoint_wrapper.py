"""fairscale (pip ``fairscale``) activation checkpointing, ``fairscale.nn.checkpoint_wrapper`` around each
pre-norm transformer block (causal self-attention + GELU feed-forward, width 64, 4 heads): its own
``CheckpointFunction`` (an autograd Function that runs the block under ``torch.no_grad`` and reruns it in the
backward, with a dummy tensor that requires grad), 2 layers, vocabulary 128, 8 tokens."""
import torch.nn as nn
from fairscale.nn import checkpoint_wrapper
from other_common import (HEADS, HIDDEN, LAYERS, CausalAttention, FeedForward, causal_lm_loss,
                          examples_of, ids_batch, sgd, version, wrapped_lm)

LIBRARY, VERSION = "fairscale", version("fairscale")
SOURCE = "fairscale/nn/checkpoint/checkpoint_activations.py (checkpoint_wrapper, CheckpointFunction)"
HEADS_, KV_HEADS_ = HEADS, HEADS


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.ff = CausalAttention(HIDDEN), FeedForward(HIDDEN)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


model = wrapped_lm(lambda: nn.Sequential(*[checkpoint_wrapper(Block()) for _ in range(LAYERS)]))

batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
