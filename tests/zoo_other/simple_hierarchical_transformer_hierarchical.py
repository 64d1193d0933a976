"""lucidrains' simple hierarchical transformer (``simple_hierarchical_transformer.HierarchicalTransformer``, pip
``simple-hierarchical-transformer``), its own classes unchanged, configured as its README's two-hierarchy decoder:
a fine stream (compression 1) and a 2x-compressed stream (a causal ``Conv1d`` of kernel 2, SiLU and a 1x1 conv over
the token embeddings: ``Compress``), each with a LayerNorm after the embedding. Each of the 2 layers runs a
``HierarchicalBlock`` per stream (token shift, pre-RMSNorm ``F.normalize`` attention and GELU feed-forward): the fine
stream's attention is ``local_attention.LocalMHA`` (causal windows of 4, its rotary and ``look_backward``), the coarse
stream's is full causal attention (fused ``to_qkv``, xPos rotary from ``rotary_embedding_torch``, ``einsum``
attention, ``Attend`` with ``use_flash_attn=False``) over the stream folded axially ``b (n c) d -> (b c) n d``;
then ``HierarchicalMerge`` (each stream repeated to full length, concatenated, RMSNorm, a SiLU MLP) is added to the
fine stream. dim 64, 4 heads of 16, ff_mult 2, seq_len 8, vocabulary 128; its auxiliary losses (reconstruction,
next-latent prediction) are off (weights 0), so ``model(ids)`` returns the fine stream's logits
``[batch, seq, vocab]``.
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, \
    version
from simple_hierarchical_transformer import HierarchicalTransformer

LIBRARY, VERSION = "simple-hierarchical-transformer", version("simple-hierarchical-transformer")
SOURCE = "simple_hierarchical_transformer/simple_hierarchical_transformer.py (HierarchicalTransformer, Compress, " \
         "HierarchicalBlock, Attention, HierarchicalMerge), simple_hierarchical_transformer/attention.py (Attend), " \
         "local_attention/transformer.py (LocalMHA), rotary_embedding_torch"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention


def model():
    torch.manual_seed(0)
    return HierarchicalTransformer(
        num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, seq_len=SEQ, dim_head=HEAD_DIM, heads=HEADS, ff_mult=2,
        hierarchies=(1, 2), window_sizes=(4, None), recon_loss_weight=0.0, next_latent_loss_weight=0.0,
        use_flash_attn=False)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
