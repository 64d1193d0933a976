"""revtorch (pip ``revtorch``): ``ReversibleSequence`` of ``ReversibleBlock``s (its autograd Function
``_ReversibleModuleFunction`` runs the blocks under ``torch.no_grad`` and recomputes them in the backward), each
block f = pre-norm causal self-attention, g = pre-norm GELU feed-forward over half the features (32 of 64), 2 layers,
4 heads, vocabulary 128, 8 tokens."""
import torch.nn as nn
from other_common import (HEADS, HIDDEN, LAYERS, CausalAttention, FeedForward, causal_lm_loss,
                          examples_of, ids_batch, sgd, version, wrapped_lm)
from revtorch import ReversibleBlock, ReversibleSequence

LIBRARY, VERSION = "revtorch", version("revtorch")
SOURCE = "revtorch/revtorch.py (ReversibleSequence, ReversibleBlock, _ReversibleModuleFunction)"
HEADS_, KV_HEADS_ = HEADS, HEADS
HALF = HIDDEN // 2

model = wrapped_lm(lambda: ReversibleSequence(nn.ModuleList(
    [ReversibleBlock(CausalAttention(HALF), FeedForward(HALF), split_along_dim=-1) for _ in range(LAYERS)])))

batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
