"""fairscale (pip ``fairscale``) activation checkpointing, ``fairscale.nn.checkpoint_wrapper`` around each
pre-norm transformer block (causal self-attention + GELU feed-forward, width 64, 4 heads): its own
``CheckpointFunction`` (an autograd Function that runs the block under ``torch.no_grad`` and reruns it in the
backward, with a dummy tensor that requires grad), 2 layers, vocabulary 128, 8 tokens."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn import checkpoint_wrapper
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "fairscale", version("fairscale")
SOURCE = "fairscale/nn/checkpoint/checkpoint_activations.py (checkpoint_wrapper, CheckpointFunction)"
HEADS_, KV_HEADS_ = HEADS, HEADS


class Block(nn.Module):
    def __init__(self, dim=HIDDEN, heads=HEADS):
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return x + self.ff(self.norm2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.Sequential(*[checkpoint_wrapper(Block()) for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        return self.head(self.norm(self.layers(self.embed(ids))))


def model():
    torch.manual_seed(0)
    return LM()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
