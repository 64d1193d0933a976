"""torchtitan's dense Qwen3 (``torchtitan.models.qwen3``, pip ``torchtitan`` 0.3.0), its own classes unchanged, built
as its registry's small dense flavours (``0.6B``, ``1.7B``, ``4B``) build it: ``_build_qwen3_layers`` (q/k RMSNorms per
head, rotary as cos/sin tables with theta 1e6, SwiGLU, RMSNorm) and the input embedding tied to the output head
(``enable_weight_tying``, the embedding's own init skipped), at the tiny size: dim 64, 4 query heads of 16, 2
key/value heads, 2 layers, an MLP of 128, vocabulary 128. Two changes of configuration, as
``torchtitan_qwen3_moe.py``: torchtitan's ``ScaledDotProductAttention`` as the inner attention, and q, k, v as three
projections (``fuse_qkv=False``, its ``debugmodel_non_fused_qkv`` flavour's).
"""
import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.qwen3 import _EMBEDDING_SKIP_INIT, _LINEAR_INIT, _build_qwen3_layers, _qwen3_norm
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan_llama3 import sdpa

LIBRARY, VERSION = "torchtitan", version("torchtitan")
SOURCE = "torchtitan/models/qwen3/model.py, torchtitan/models/common/{attention,decoder}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    layers = sdpa(_build_qwen3_layers(
        fuse_qkv=False, n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        hidden_dim=FFN, attn_backend="flex", rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=64, theta=1000000.0)))
    net = Qwen3Model.Config(
        vocab_size=VOCAB, dim=HIDDEN, norm=_qwen3_norm(HIDDEN), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN, param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=layers).build()
    net.init_states()
    return net


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
