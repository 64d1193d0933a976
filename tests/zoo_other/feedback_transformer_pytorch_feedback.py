"""lucidrains' Feedback Transformer (pip ``feedback-transformer-pytorch``,
``feedback_transformer_pytorch.FeedbackTransformer``), its own classes unchanged: token embedding, 2 layers of
pre-LayerNorm attention (``to_q``, a ``to_kv`` projection shared by every layer and by the memory: the same
``nn.Linear`` module object, ``shared_kv_proj``), a T5-style bucketed relative position bias (``RelativePositionBias``:
``log``, ``.long()``, ``torch.where``, an ``nn.Embedding`` of 32 buckets per head), a causal mask built by ``triu_`` and
filled in place, and a GEGLU feed-forward, plain residuals, a final LayerNorm and a linear head. The forward cuts the
sequence into chunks of ``seq_len`` (``x.split``), runs the layers on each and, after each chunk, writes the
softmax(``layer_weight``)-weighted sum of every layer's hidden states through the shared key/value projection to a
memory FIFO of ``mem_len`` that the next chunk's layers all attend to (the feedback memory). With ``seq_len=8`` there
is one chunk: the memory is computed but nothing reads it (``layer_weight`` gets no gradient). ``model(ids)``
returns logits ``[batch, 8, vocab]`` (``return_memory=False``). dim 64, 4 heads of 16 (no grouped-query form), 2
layers, vocabulary 128, ``mem_len=4``.
"""
import torch
from feedback_transformer_pytorch import FeedbackTransformer
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "feedback-transformer-pytorch", version("feedback-transformer-pytorch")
SOURCE = ("feedback_transformer_pytorch/feedback_transformer_pytorch.py (FeedbackTransformer, Attention, "
          "RelativePositionBias, FeedForward, GEGLU, PreNorm, Residual)")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form


def model():
    torch.manual_seed(0)
    return FeedbackTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, seq_len=SEQ, mem_len=4, heads=HEADS,
                               dim_head=HEAD_DIM, attn_dropout=0.0, ff_dropout=0.0)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
