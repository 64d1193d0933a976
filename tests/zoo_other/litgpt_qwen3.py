"""litgpt's Qwen3 (``litgpt.model.GPT`` with ``Config.from_name("Qwen3-0.6B")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: q/k RMSNorms per head (``norm_qk``, after the heads are split, before rotary),
grouped-query attention (2 key/value groups) in one fused ``qkv`` projection without biases, a SwiGLU MLP
(``LLaMAMLP``), RMSNorm, rotary positions (base 1e6), an untied head; dim 64, 4 query heads of 16, 2 layers, an MLP
of 128, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS, KV_HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, LLaMAMLP, RMSNorm), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS

model = builder("Qwen3-0.6B", n_query_groups=KV_HEADS)
