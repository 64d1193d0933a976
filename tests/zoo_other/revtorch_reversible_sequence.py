"""revtorch (pip ``revtorch``): ``ReversibleSequence`` of ``ReversibleBlock``s (its autograd Function
``_ReversibleModuleFunction`` runs the blocks under ``torch.no_grad`` and recomputes them in the backward), each
block f = pre-norm causal self-attention, g = pre-norm GELU feed-forward over half the features (32 of 64), 2 layers,
4 heads, vocabulary 128, 8 tokens."""
import torch
import torch.nn as nn
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, CausalAttention, FeedForward, causal_lm_loss, examples_of, ids_batch, sgd, version
from revtorch import ReversibleBlock, ReversibleSequence

LIBRARY, VERSION = "revtorch", version("revtorch")
SOURCE = "revtorch/revtorch.py (ReversibleSequence, ReversibleBlock, _ReversibleModuleFunction)"
HEADS_, KV_HEADS_ = HEADS, HEADS
HALF = HIDDEN // 2


class RevLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = ReversibleSequence(nn.ModuleList(
            [ReversibleBlock(CausalAttention(HALF), FeedForward(HALF), split_along_dim=-1) for _ in range(LAYERS)]))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        return self.head(self.norm(self.layers(self.embed(ids))))


def model():
    torch.manual_seed(0)
    return RevLM()


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
