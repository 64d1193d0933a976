"""OLMo-core's OLMo 3 (``olmo_core.nn.transformer``, pip ``ai2-olmo-core``), its own classes unchanged: built as
``TransformerConfig.olmo3_*`` builds every OLMo 3 size (the OLMo 2 block of ``olmo_core_olmo2.py``: ``llama_like``
with the reordered-norm block, q/k norms over all heads, RMSNorm, rotary theta 500000; plus sliding-window attention
by ``SlidingWindowAttentionConfig(pattern=[w, w, w, -1], force_full_attention_on_last_layer=True)``: three
windowed layers then one of full attention), at the tiny size: d_model 64, 4 query heads of 16, 2 key/value heads,
4 layers (so the pattern is whole), an MLP of 128, vocabulary 128, and a window of 3 tokens (OLMo 3's 4096 shrunk
below the sequence of 8, so it masks). One change of configuration: OLMo-core's ``torch`` attention backend (SDPA
with its boolean sliding-window mask, ``olmo_core/nn/attention/backend.py``) in place of ``flash_2``, which needs a
GPU; initialised by OLMo-core's own ``init_weights``.
"""
import torch
from olmo_core.nn.attention import SlidingWindowAttentionConfig
from olmo_core.nn.attention.backend import AttentionBackendName
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd,
                          version)

LIBRARY, VERSION = "OLMo-core", version("ai2-olmo-core")
SOURCE = "olmo_core/nn/transformer/{model,block}.py, olmo_core/nn/attention/{__init__,backend}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
WINDOW = 3


def config():
    return TransformerConfig.llama_like(
        d_model=HIDDEN, vocab_size=VOCAB, n_layers=4, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        block_name=TransformerBlockType.reordered_norm, qk_norm=True, rope_theta=500_000, layer_norm_eps=1e-6,
        feed_forward=FeedForwardConfig(hidden_size=FFN, bias=False),
        sliding_window=SlidingWindowAttentionConfig(
            force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=True,
            pattern=[WINDOW, WINDOW, WINDOW, -1]),
        attn_backend=AttentionBackendName.torch)


def model():
    torch.manual_seed(0)
    net = config().build(init_device="cpu")
    net.init_weights(device=torch.device("cpu"))
    return net


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
