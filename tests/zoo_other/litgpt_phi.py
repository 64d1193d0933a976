"""litgpt's Phi-2 (``litgpt.model.GPT`` with ``Config.from_name("phi-2")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: a parallel residual with one LayerNorm shared by attention and MLP
(``shared_attention_norm``), q/k/v in one fused ``qkv`` projection with biases (multi-head: 4 key/value heads),
partial rotary positions (``rotary_percentage`` 0.4: 6 of 16 dims, as ``int(0.4 * 16)``), a tanh-GELU MLP
(``GptNeoxMLP``) with biases, an untied head with a bias (``lm_head_bias``); dim 64, 4 heads of 16, 2 layers, an MLP
of 128, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GptNeoxMLP), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, HEADS

model = builder("phi-2", n_query_groups=HEADS)
