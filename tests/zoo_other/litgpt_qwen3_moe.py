"""litgpt's Qwen3 MoE (``litgpt.model.GPT`` with ``Config.from_name("Qwen3-30B-A3B")``, pip ``litgpt``), its own
classes unchanged, at the tiny size: q/k RMSNorms per head (``norm_qk``), grouped-query attention (2 key/value groups)
in one fused ``qkv`` projection without biases, RMSNorm, rotary positions (base 1e6), an untied head, and a mixture
of experts in place of every MLP (``LLaMAMoE``: a router ``nn.Linear``, ``torch.topk`` of its logits, softmax over the
chosen ones, then a Python loop over a ``ModuleList`` of SwiGLU experts of ``moe_intermediate_size``, each run on its
tokens as ``torch.where(mask)`` finds them, its output added back by ``y[token_idx] += probs * expert(x[token_idx])``);
dim 64, 4 query heads of 16, 2 layers, 4 experts of 32 top-2 (Qwen3-30B-A3B's 128 experts of 768 top-8, shrunk),
vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS, HIDDEN, KV_HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, LLaMAMoE, LLaMAMLP), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, HIDDEN // 2

model = builder("Qwen3-30B-A3B", n_query_groups=KV_HEADS, intermediate_size=HIDDEN * 2,
                moe_intermediate_size=EXPERT_FFN, n_expert=EXPERTS, n_expert_per_token=TOP_K)
