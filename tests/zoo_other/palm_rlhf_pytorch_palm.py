"""lucidrains' PaLM from PaLM-rlhf-pytorch (``palm_rlhf_pytorch.PaLM``, pip ``PaLM-rlhf-pytorch``), its own classes
unchanged, pretrained as its README trains it: ``loss = model(seq, return_loss = True)`` on sequences one token longer
than the context, the model itself splitting them into inputs ``x[:, :-1]`` and labels ``x[:, 1:]`` and computing
the cross-entropy (``ignore_index=0``). Layout: ``Residual(ParallelTransformerBlock)`` blocks in a ``ModuleList``:
LayerNorm without a bias (``gamma + 1``, a zero ``beta`` buffer), one fused projection ``fused_attn_ff_proj`` (q, the
one key, the one value and the SwiGLU's two halves side by side: multi-query attention), rotary positions with xPos
scaling (queries by ``scale``, keys by ``scale ** -1``; the tables and the causal mask cached with
``register_buffer`` on first use), ``einsum`` attention (``Attention``, flash off) and a parallel SwiGLU
feed-forward, a head tied to the embedding; dim 64, 4 heads of 16, 2 layers, ff_mult 2, vocabulary 128. Installed
without its requirements (``accelerate`` and the RL helpers are imported, not used here).
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, examples_of, returned_loss, sgd, shifted_batch, version
from palm_rlhf_pytorch import PaLM

LIBRARY, VERSION = "PaLM-rlhf-pytorch", version("PaLM-rlhf-pytorch")
SOURCE = "palm_rlhf_pytorch/{palm,attention}.py (PaLM, ParallelTransformerBlock, Attention, RotaryEmbedding)"
HEADS_, KV_HEADS_ = HEADS, 1  # multi-query


def model():
    torch.manual_seed(0)
    return PaLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS, ff_mult=2)


batch = shifted_batch()  # the model cuts inputs and labels from L + 1 tokens itself
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = returned_loss  # the model's own loss (return_loss=True returns the cross-entropy alone)


optimizer = sgd
