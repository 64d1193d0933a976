"""A Kimi-K2-shaped mixture of experts (about 1.04T parameters): DeepSeek-V3's architecture with 61 layers (the
first dense), hidden 7168, 384 routed experts of 2048 (top 8) and one shared expert, 64 attention heads with MLA,
vocabulary 163,840, as Moonshot's report describes it; built from ``DeepseekV3Config`` (nothing downloaded) as a
model file for ``benchmarks/memory_plans.py``. tracepp plans it on meta tensors. ``KIMI_K2_BATCH``: the global
batch (16 by default), ``KIMI_K2_SEQ``: tokens per sample (4096)."""
import os

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

BATCH, SEQ, VOCAB = int(os.environ.get("KIMI_K2_BATCH", "16")), int(os.environ.get("KIMI_K2_SEQ", "4096")), 163840


def model():
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=SEQ, rope_scaling=None))


def _data(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def example_inputs():
    return (_data(0)[0],)


def example_kwargs():
    return {"use_cache": False}


def example_target():
    return _data(0)[1]


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))
