"""litgpt's Pythia (``litgpt.model.GPT`` with ``Config.from_name("pythia-160m")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: GPT-NeoX style blocks with a parallel residual (attention and MLP both read the block
input, through two LayerNorms), q/k/v in one fused ``qkv`` projection with biases (multi-head: 4 key/value heads),
partial rotary positions (a quarter of each head, ``rotary_percentage`` 0.25: 4 of 16 dims), a GELU MLP
(``GptNeoxMLP``) with biases, LayerNorm, an untied head; dim 64, 4 heads of 16, 2 layers, an MLP of 128,
vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GptNeoxMLP), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, HEADS

model = builder("pythia-160m", n_query_groups=HEADS)
