"""lucidrains' Block-Recurrent Transformer (``block_recurrent_transformer_pytorch.BlockRecurrentTransformer``, pip
``block-recurrent-transformer-pytorch``, installed with ``--no-deps``: its declared dependency
``memorizing-transformers-pytorch`` pulls ``faiss-gpu`` and is never imported by the module), its own classes
unchanged. The 8 tokens are cut into 2 blocks of 4 (``split``) processed in a Python loop; each of the 2 layers is
an ``AttentionBlock`` (pre-LayerNorm multi-query attention: 4 query heads of 16 sharing one key/value head, rotary
positions with xpos scaling, transformer-XL memories: the previous block's keys/values, kept by ``MemoryManager``,
prepended to the keys) and a GEGLU feed-forward. Layer 1 is the recurrent layer (the library's default
``depth // 2``): its ``StateContainer`` holds 4 learned state vectors that the block's tokens read by cross-attention
(``q_to_state``, queries per head against the states' single key/value head, qk RMSNorm) and that are written after
the block (the states' self-attention and cross-attention to the block's keys/values, ``to_state_out``, then a
learned-EMA gate ``learned_ema_beta``); the written states become the next block's read states (gradients flow through
them). The state is kept between the read and the write as Python attributes of the container (``self.cache``,
``self.next_read_state``). dim 64, 2 layers, 4 heads of 16, ff_mult 3 (GEGLU inner 128), vocabulary 128, block width 4, max_seq_len 8.
``model(ids)`` is one call per batch (states start from ``init_state``): it returns ``(logits [batch, 8, vocab],
xl memories, states)``, the last two detached.
"""
import torch
from block_recurrent_transformer_pytorch import BlockRecurrentTransformer
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "block-recurrent-transformer-pytorch", version("block-recurrent-transformer-pytorch")
SOURCE = "block_recurrent_transformer_pytorch/block_recurrent_transformer_pytorch.py (BlockRecurrentTransformer, " \
         "AttentionBlock, StateContainer, Attention, Attend, MemoryManager, RotaryEmbedding, FeedForward)"
HEADS_, KV_HEADS_ = HEADS, 1  # multi-query attention: one key/value head (to_kv is dim_head * 2 wide)
BLOCK = SEQ // 2


def model():
    torch.manual_seed(0)
    return BlockRecurrentTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS,
                                     ff_mult=3, max_seq_len=SEQ, block_width=BLOCK, num_state_vectors=BLOCK,
                                     use_flash_attn=False)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
