"""memcnn (pip ``memcnn``): per layer an ``InvertibleModuleWrapper(AdditiveCoupling(Fm, Gm, split_dim=-1),
keep_input=False)`` (its ``InvertibleCheckpointFunction`` runs the coupling under ``torch.no_grad``, frees the input,
and in the backward inverts the output and recomputes), Fm = causal self-attention, Gm = GELU feed-forward over half
the features (32 of 64), 2 layers, 4 heads, vocabulary 128, 8 tokens."""
import torch.nn as nn
from other_common import (HEADS, HIDDEN, LAYERS, CausalAttention, FeedForward, causal_lm_loss,
                          examples_of, ids_batch, sgd, version, wrapped_lm)
from memcnn import AdditiveCoupling, InvertibleModuleWrapper

LIBRARY, VERSION = "memcnn", version("memcnn")
SOURCE = ("memcnn/models/revop.py (InvertibleModuleWrapper, InvertibleCheckpointFunction), "
          "memcnn/models/additive.py (AdditiveCoupling)")
HEADS_, KV_HEADS_ = HEADS, HEADS
HALF = HIDDEN // 2

model = wrapped_lm(lambda: nn.Sequential(*[
    InvertibleModuleWrapper(AdditiveCoupling(CausalAttention(HALF), FeedForward(HALF), split_dim=-1),
                            keep_input=False, keep_input_inverse=False) for _ in range(LAYERS)]))

batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
