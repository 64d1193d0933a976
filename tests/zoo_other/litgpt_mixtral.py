"""litgpt's Mixtral (``litgpt.model.GPT`` with ``Config.from_name("Mixtral-8x7B-v0.1")``, pip ``litgpt`` 0.5.13), its
own classes unchanged, at the tiny size: 2 key/value groups (grouped-query attention) in one fused ``qkv``
projection, RMSNorm, rotary positions (base 1e6), an untied head, and a mixture of experts in place of the MLP
(``LLaMAMoE``: a router ``nn.Linear``, ``torch.topk`` of its logits, softmax over the chosen two, then a Python loop
over a ``ModuleList`` of SwiGLU experts, each run on its tokens as ``torch.where(mask)`` finds them, its output
added back by ``y[token_idx] += probs * expert(x[token_idx])``); dim 64, 4 query heads of 16, 2 layers, 4 experts
of 64 top-2, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS, KV_HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, LLaMAMoE, LLaMAMLP), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 64

model = builder("Mixtral-8x7B-v0.1", n_query_groups=KV_HEADS, intermediate_size=EXPERT_FFN, n_expert=EXPERTS,
                n_expert_per_token=TOP_K)
