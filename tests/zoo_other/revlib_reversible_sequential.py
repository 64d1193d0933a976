"""revlib (pip ``revlib``): ``ReversibleSequential`` (memory mode ``autograd_function``: each module wrapped in
a ``ReversibleModule`` whose ``_ReversibleHalfResidualSwapFn`` runs it in an autograd Function and recomputes it in the
backward, passing the recomputed inputs back as the "gradients" of two extra stream tensors; ``_ReplaceGrad`` at the
end), layers = [causal self-attention, GELU feed-forward] x 2 over half the features (32 of 64), 4 heads, vocabulary
128, 8 tokens."""
import torch
import torch.nn as nn
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, CausalAttention, FeedForward, causal_lm_loss, examples_of, ids_batch, sgd, version
from revlib import ReversibleSequential

LIBRARY, VERSION = "revlib", version("revlib")
SOURCE = ("revlib/core.py (ReversibleSequential, ReversibleModule, _ReversibleHalfResidualSwapFn, "
          "_ReplaceGrad)")
HEADS_, KV_HEADS_ = HEADS, HEADS
HALF = HIDDEN // 2


class RevLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = ReversibleSequential(*[m for _ in range(LAYERS) for m in (CausalAttention(HALF), FeedForward(HALF))],
                                           split_dim=-1)
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
