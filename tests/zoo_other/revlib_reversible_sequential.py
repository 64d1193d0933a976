"""revlib (pip ``revlib``): ``ReversibleSequential`` (memory mode ``autograd_function``: each module wrapped in
a ``ReversibleModule`` whose ``_ReversibleHalfResidualSwapFn`` runs it in an autograd Function and recomputes it in the
backward, passing the recomputed inputs back as the "gradients" of two extra stream tensors; ``_ReplaceGrad`` at the
end), layers = [causal self-attention, GELU feed-forward] x 2 over half the features (32 of 64), 4 heads, vocabulary
128, 8 tokens."""
from other_common import (HEADS, HIDDEN, LAYERS, CausalAttention, FeedForward, causal_lm_loss,
                          examples_of, ids_batch, sgd, version, wrapped_lm)
from revlib import ReversibleSequential

LIBRARY, VERSION = "revlib", version("revlib")
SOURCE = ("revlib/core.py (ReversibleSequential, ReversibleModule, _ReversibleHalfResidualSwapFn, "
          "_ReplaceGrad)")
HEADS_, KV_HEADS_ = HEADS, HEADS
HALF = HIDDEN // 2

model = wrapped_lm(lambda: ReversibleSequential(
    *[m for _ in range(LAYERS) for m in (CausalAttention(HALF), FeedForward(HALF))], split_dim=-1))

batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
