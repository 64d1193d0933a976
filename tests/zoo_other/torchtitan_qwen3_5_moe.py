"""torchtitan's Qwen3.5 MoE (``torchtitan.models.qwen3_5``, pip ``torchtitan`` 0.3.0), its own classes unchanged,
built as its registry's ``debugmodel_moe`` builds it (``_build_qwen35_moe_layers``; ``Qwen35Model``): full
attention with a query twice as wide whose second half gates the output (``out * sigmoid(gate)``), q/k
``OffsetRMSNorm`` per head (``(1 + w) * norm(x)``), partial rotary (8 of 16 dims) through ``MRoPE`` read with plain
text positions, a softmax top-2 router with normalised scores, routed experts as grouped matmuls over 3-D weights,
and a shared SwiGLU expert scaled by a sigmoid gate of its own (``SigmoidGatedFeedForward``), at the tiny size:
dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, 4 experts of 64 top-2, a shared expert of 64,
vocabulary 128; the model's vision encoder (built by ``Qwen35Model`` whatever the batch) at 1 layer of 32, unused by
text batches. Torchtitan 0.3.0 has no Llama 4: this is its MoE with a shared expert that is not DeepSeek-V3's.

Three changes of configuration: torchtitan's ``ScaledDotProductAttention`` as the inner attention (as
``torchtitan_llama3.py``); ``full_attention_interval=1``, so every layer is full attention: Qwen3.5's other
layers (three of four) are Gated DeltaNet, whose kernels are flash-linear-attention's Triton ones
(``fla.ops.gated_delta_rule``, imported by ``qwen3_5/model.py:16``; fla-core 0.6.0 installed ``--no-deps`` for
that import) and do not run on CPU; and the forward's ``positions`` (0..seq-1) and
``special_tokens`` (which ``Qwen35Model.forward`` reads even without images) given as keyword arguments; the
positions as ``[1, seq]`` (its rotary broadcasts a batch of 1), so that one value serves every microbatch.
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, sgd, token_batch, version
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.qwen3_5 import (_EMBEDDING_INIT, _build_qwen35_moe_layers, _offset_norm,
                                       _output_linear_init, _qwen35_vision_encoder_config)
from torchtitan.models.qwen3_5.model import Qwen35Model
from torchtitan.models.qwen3_5.rope import MRoPE
from torchtitan_llama3 import sdpa

LIBRARY, VERSION = "torchtitan", version("torchtitan")
SOURCE = ("torchtitan/models/qwen3_5/{model,rope}.py, torchtitan/models/common/{attention,moe,feed_forward}.py")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
ROTARY = 8
SPECIAL_TOKENS = {"image_id": VOCAB - 2, "video_id": VOCAB - 1}


def model():
    torch.manual_seed(0)
    layers = sdpa(_build_qwen35_moe_layers(
        n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rotary_dim=ROTARY,
        rope=MRoPE.Config(dim=ROTARY, max_seq_len=64, theta=10_000_000.0, mrope_section=[2, 1, 1]),
        moe_hidden_dim=64, num_experts=4, top_k=2, shared_expert_hidden_dim=64,
        n_key_heads=2, n_value_heads=4, key_head_dim=16, value_head_dim=16, full_attention_interval=1,
        attn_backend="flex", moe_comm_backend="standard"))
    net = Qwen35Model.Config(
        vocab_size=VOCAB, dim=HIDDEN, norm=_offset_norm(HIDDEN),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB, param_init=_output_linear_init(HIDDEN)),
        layers=layers,
        vision_encoder=_qwen35_vision_encoder_config(
            dim=32, ffn_dim=32, num_layers=1, num_heads=2, patch_size=2, temporal_patch_size=1,
            spatial_merge_size=1, out_hidden_size=HIDDEN, num_position_embeddings=16)).build()
    net.init_states()
    return net


def batch(step: int):
    ids, target = token_batch(step)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, seq]: the same for every sample and microbatch
    return (ids,), {"positions": positions, "special_tokens": dict(SPECIAL_TOKENS)}, target


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return batch(0)[1]


def example_target():
    return batch(0)[2]


loss_fn = causal_lm_loss
optimizer = sgd
