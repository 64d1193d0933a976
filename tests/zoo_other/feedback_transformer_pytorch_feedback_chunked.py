"""lucidrains' Feedback Transformer (pip ``feedback-transformer-pytorch``,
``feedback_transformer_pytorch.FeedbackTransformer``), its own classes unchanged, with its feedback memory at work:
``seq_len=2`` (the library's default chunk), so the 8 tokens run as 4 chunks of 2 in a Python loop (``x.split``).
Each chunk runs 2 layers of pre-LayerNorm attention (``to_q``, a ``to_kv`` projection shared by every layer and by
the memory: the same ``nn.Linear`` module object, ``shared_kv_proj``; a T5-style bucketed relative position bias,
``RelativePositionBias``; a causal mask built by ``triu_`` and filled in place) and a GEGLU feed-forward with plain
residuals; after each chunk the softmax(``layer_weight``)-weighted sum of the chunk's hidden states at every layer
goes through the shared key/value projection into a memory FIFO (``torch.cat``, keeping the last ``mem_len=4``
positions) that every layer of the following chunks attends to before its own keys/values (gradients flow through
the memory). A final LayerNorm and a linear head; ``model(ids)`` returns logits ``[batch, 8, vocab]``. dim 64, 4 heads
of 16 (no grouped-query form), 2 layers, vocabulary 128.
"""
import torch
from feedback_transformer_pytorch import FeedbackTransformer
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "feedback-transformer-pytorch", version("feedback-transformer-pytorch")
SOURCE = ("feedback_transformer_pytorch/feedback_transformer_pytorch.py (FeedbackTransformer, Attention, "
          "RelativePositionBias, FeedForward, GEGLU, PreNorm, Residual)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
CHUNK, MEMORY = 2, 4


def model():
    torch.manual_seed(0)
    return FeedbackTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, seq_len=CHUNK, mem_len=MEMORY, heads=HEADS,
                               dim_head=HEAD_DIM, attn_dropout=0.0, ff_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
