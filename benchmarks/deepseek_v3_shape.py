"""DeepSeek-V3 at full size (61 layers, the first 3 dense; 256 routed experts top-8 and 1 shared expert; MLA;
vocabulary 129,280; about 671B parameters), built from its config (nothing downloaded), as a model file for
``benchmarks/moe_plan.py``. tracepp plans it on meta tensors: nothing of its weights is ever allocated.
``DEEPSEEK_V3_BATCH``: the global batch (16 by default; 512 for 32 data-parallel replicas of 16 microbatches).

``DEEPSEEK_V3_SHAPE=kimi_k2`` gives a Kimi-K2-shaped model of the same architecture (about 1.04T parameters: 61
layers, the first dense, hidden 7168, 384 routed experts of 2048 top-8 and one shared expert, 64 heads with MLA,
vocabulary 163,840, as Moonshot's report describes it), for ``benchmarks/memory_plans.py``."""
import os

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

# settings over DeepseekV3Config's defaults (which are DeepSeek-V3's), per shape
SHAPES = {
    "v3": dict(vocab_size=129280),
    "kimi_k2": dict(vocab_size=163840, first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64,
                    n_routed_experts=384, n_group=1, topk_group=1),
}
SHAPE = SHAPES[os.environ.get("DEEPSEEK_V3_SHAPE", "v3")]
BATCH, SEQ, VOCAB = int(os.environ.get("DEEPSEEK_V3_BATCH", "16")), 4096, SHAPE["vocab_size"]


def model():
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(max_position_embeddings=SEQ, rope_scaling=None, **SHAPE))


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
