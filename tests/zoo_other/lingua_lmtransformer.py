"""Meta Lingua's LMTransformer (github.com/facebookresearch/lingua ``apps/main/transformer.py`` on
``lingua/transformer.py``'s BaseTransformer, TransformerBlock, Attention, FeedForward, RMSNorm, RotaryEmbedding),
vendored unchanged in ``lingua/`` and ``apps/`` (not on PyPI; lingua imports ``xformers.ops``, so pip ``xformers``
must be installed). Built as ``apps/main/train.py`` builds it: ``LMTransformer(LMTransformerArgs(...))`` then
``torch.manual_seed(seed); model.init_weights()`` (lingua's own truncated-normal init), here on CPU directly instead
of on the meta device. Llama layout: RMSNorm in fp32, rotary positions as real 2x2 rotation tables, grouped-query
attention by ``repeat_kv``'s expand and reshape, ``F.scaled_dot_product_attention`` with ``is_causal`` (the default
``attn_impl="sdpa"``), a SwiGLU feed-forward (w1, w3, w2), an untied output head; 4 query heads of 16, 2 key/value
heads, 2 layers, feed-forward 128 (``ffn_dim_multiplier=0.75``, ``multiple_of=32``), vocabulary 128. Called as
``model(ids)`` it returns the logits (``model(ids, target)`` would return lingua's own loss).
"""
import torch
from apps.main.transformer import LMTransformer, LMTransformerArgs
from other_common import HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd

LIBRARY, VERSION = "lingua", "437d680 (vendored)"
SOURCE = ("facebookresearch/lingua apps/main/transformer.py (LMTransformer), lingua/transformer.py (BaseTransformer, "
          "TransformerBlock, Attention, FeedForward, RMSNorm, RotaryEmbedding)")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    m = LMTransformer(LMTransformerArgs(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                        ffn_dim_multiplier=0.75, multiple_of=32, max_seqlen=SEQ * 8,
                                        vocab_size=VOCAB, weight_tying=False, seed=0))
    torch.manual_seed(0)
    m.init_weights()
    return m


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
