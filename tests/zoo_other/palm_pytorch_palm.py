"""lucidrains' PaLM (``palm_pytorch.PaLM``, pip ``PaLM-pytorch``), its own classes unchanged: parallel attention
and feed-forward blocks from one fused projection (``fused_attn_ff_proj``: q, the one key, the one value and the
SwiGLU's two halves side by side), multi-query attention (one key/value head), rotary positions, LayerNorm without
a bias, a head tied to the embedding, attention and output as ``einsum``; dim 64, 4 heads of 16, 2 layers, ff_mult
2, vocabulary 128. Installed without its ``triton`` requirement (only its ``palm_pytorch.triton`` kernels use it).
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from palm_pytorch import PaLM

LIBRARY, VERSION = "PaLM-pytorch", version("PaLM-pytorch")
SOURCE = "palm_pytorch/palm_pytorch.py (PaLM, ParallelTransformerBlock, SwiGLU, RotaryEmbedding, LayerNorm)"
HEADS_, KV_HEADS_ = HEADS, 1  # multi-query


def model():
    torch.manual_seed(0)
    return PaLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS, ff_mult=2)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
