"""OLMo-core's OLMo 2 (``olmo_core.nn.transformer``, pip ``ai2-olmo-core``), its own classes unchanged: built as
``TransformerConfig.olmo2_*`` builds every OLMo 2 size (``llama_like`` with the reordered-norm block: the norms after
attention and the MLP, q/k norms over all heads, RMSNorm, rotary theta 500000), at the tiny size: d_model 64, 4
query heads of 16, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128; initialised by OLMo-core's own
``init_weights``.
"""
import torch
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)

LIBRARY, VERSION = "OLMo-core", version("ai2-olmo-core")
SOURCE = "olmo_core/nn/transformer/{model,block}.py, olmo_core/nn/attention, olmo_core/nn/layer_norm.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def config():
    return TransformerConfig.llama_like(
        d_model=HIDDEN, vocab_size=VOCAB, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        block_name=TransformerBlockType.reordered_norm, qk_norm=True, rope_theta=500_000, layer_norm_eps=1e-6,
        feed_forward=FeedForwardConfig(hidden_size=FFN, bias=False))


def model():
    torch.manual_seed(0)
    net = config().build(init_device="cpu")
    net.init_weights(device=torch.device("cpu"))
    return net


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
