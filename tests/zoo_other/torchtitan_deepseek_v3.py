"""torchtitan's DeepSeek-V3 (``torchtitan.models.deepseek_v3``, pip ``torchtitan`` 0.3.0), its own classes unchanged,
built as its registry's ``debugmodel`` builds it (``_build_dsv3_layers``: multi-head latent attention without a
query low-rank pair, one dense first layer, then mixture-of-experts layers with a shared expert, softmax routing,
rotary in complex numbers with YaRN scaling), at the tiny size: dim 64, 4 heads (nope 16 + rope 8 of each query
and key, values of 16, a key/value latent of 32), 2 layers, 4 routed experts of 64 top-2 and 1 shared, vocabulary
128. One change of configuration: torchtitan's ``ScaledDotProductAttention`` as the inner attention (as
``torchtitan_llama3.py``).
"""
import torch
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan_llama3 import sdpa

LIBRARY, VERSION = "torchtitan", version("torchtitan")
SOURCE = "torchtitan/models/deepseek_v3/model.py, torchtitan/models/common/{attention,moe}.py"
HEADS_, KV_HEADS_ = HEADS, HEADS  # MLA: a key and value per head, from one latent


def model():
    torch.manual_seed(0)
    layers = sdpa(_build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=HIDDEN, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.70, dense_hidden_dim=128,
        moe_hidden_dim=64, num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=256, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=64)))
    net = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=HIDDEN,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=_output_linear_init(HIDDEN)),
        layers=layers).build()
    net.init_states()
    return net


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
