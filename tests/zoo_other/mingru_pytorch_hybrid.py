"""lucidrains' minGRU-attention hybrid language model (``minGRU_pytorch.hybridLM``, pip ``minGRU-pytorch``), its own
classes unchanged, Hymba-style: each pre-RMSNorm block's ``minGRUAttnHybrid`` runs two branches side by side on the
same input, a fused ``to_qkv`` projection (``rearrange 'b n (qkv h d) -> qkv b h n d'``) into causal
``scaled_dot_product_attention`` and a ``minGRU`` of inner width heads x dim_head (no output projection; its log-space
Heinsen scan: ``cumsum``, ``logcumsumexp``), each split into heads and RMS-normalised per head (``nn.RMSNorm(dim_head)``),
mixed by a learned per-token, per-head sigmoid gate (``to_mix``: RMSNorm then a ``Linear(dim, heads)``), merged and
projected out; then a GELU MLP with biases; a final RMSNorm and an untied head; dim 64, 4 heads of 16, 2 layers,
ff_mult 2, vocabulary 128.
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from minGRU_pytorch.hybridLM import hybridLM

LIBRARY, VERSION = "minGRU-pytorch", version("minGRU-pytorch")
SOURCE = "minGRU_pytorch/hybridLM.py (hybridLM), minGRU_pytorch/hybrid.py (minGRUAttnHybrid), " \
         "minGRU_pytorch/minGRU.py (minGRU, heinsen_associative_scan_log)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form


def model():
    torch.manual_seed(0)
    return hybridLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, ff_mult=2, heads=HEADS, dim_head=HEAD_DIM)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
