"""memcnn (pip ``memcnn``): per layer an ``InvertibleModuleWrapper(AdditiveCoupling(Fm, Gm, split_dim=-1),
keep_input=False)`` (its ``InvertibleCheckpointFunction`` runs the coupling under ``torch.no_grad``, frees the input,
and in the backward inverts the output and recomputes), Fm = causal self-attention, Gm = GELU feed-forward over half
the features (32 of 64), 2 layers, 4 heads, vocabulary 128, 8 tokens."""
import torch
import torch.nn as nn
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, CausalAttention, FeedForward, causal_lm_loss, examples_of, ids_batch, sgd, version
from memcnn import AdditiveCoupling, InvertibleModuleWrapper

LIBRARY, VERSION = "memcnn", version("memcnn")
SOURCE = ("memcnn/models/revop.py (InvertibleModuleWrapper, InvertibleCheckpointFunction), "
          "memcnn/models/additive.py (AdditiveCoupling)")
HEADS_, KV_HEADS_ = HEADS, HEADS
HALF = HIDDEN // 2


class RevLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.Sequential(*[InvertibleModuleWrapper(AdditiveCoupling(CausalAttention(HALF), FeedForward(HALF), split_dim=-1),
                                                              keep_input=False, keep_input_inverse=False)
                                      for _ in range(LAYERS)])
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
