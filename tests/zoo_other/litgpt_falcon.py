"""litgpt's Falcon (``litgpt.model.GPT`` with ``Config.from_name("falcon-7b")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: multi-query attention (one key/value group, as Falcon-7B's 71 query heads to 1) in one
fused ``qkv`` projection, no biases, a parallel residual (attention and MLP both read the block's input,
``parallel_residual``) through one shared LayerNorm (``shared_attention_norm``: ``norm_2`` is ``None`` and the MLP
reads ``norm_1``'s output), a GELU MLP (``GptNeoxMLP``), rotary positions over the whole head, an untied head; dim
64, 4 query heads of 16, 2 layers, an MLP of 128, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GptNeoxMLP), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, 1

model = builder("falcon-7b", n_query_groups=1)
