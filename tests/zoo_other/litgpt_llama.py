"""litgpt's Llama 3 (``litgpt.model.GPT`` with ``Config.from_name("Llama-3-8B")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: 2 key/value groups (grouped-query attention) in one fused ``qkv`` projection, a SwiGLU MLP
(``LLaMAMLP``), RMSNorm, rotary positions, an untied head; dim 64, 4 query heads of 16, 2 layers, vocabulary 128.
The model is built by ``litgpt_gemma.py`` with this config name.
"""
import os

os.environ["LITGPT_CONFIG"] = "Llama-3-8B"
from litgpt_gemma import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                          example_kwargs, example_target, loss_fn, model, optimizer)
