"""litgpt's Mistral (``litgpt.model.GPT`` with ``Config.from_name("Mistral-7B-v0.1")``, pip ``litgpt``), its own
classes unchanged, at the tiny size: sliding-window attention on every layer (a window of 4 tokens, shorter than the
sequence of 8, so it masks; litgpt builds the window's mask with a Python loop of slice writes into a
``torch.full`` and passes it to SDPA), grouped-query attention (2 key/value groups) in one fused ``qkv`` projection,
rotary positions, a SwiGLU MLP (``LLaMAMLP``), RMSNorm, an untied head; dim 64, 4 query heads of 16, 2 layers, an MLP
of 128, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS, KV_HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, LLaMAMLP), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
WINDOW = 4

model = builder("Mistral-7B-v0.1", n_query_groups=KV_HEADS, sliding_window_size=WINDOW)
