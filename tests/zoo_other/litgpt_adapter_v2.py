"""litgpt's LLaMA-Adapter v2 (``litgpt.adapter_v2.GPT``, pip ``litgpt``), its own classes unchanged, as its
adapter-v2 fine-tune trains it (``mark_only_adapter_v2_as_trainable``): ``litgpt_adapter.py``'s prefix and gates, and
besides them every linear an ``AdapterV2Linear`` (``adapter_scale * (linear(x) + adapter_bias)``, the scale and bias
trained, the base weight frozen) and the norms trained. The model is built by ``litgpt_adapter.py``.
"""
import os

os.environ["LITGPT_ADAPTER"] = "adapter_v2"
from litgpt_adapter import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                            example_kwargs, example_target, loss_fn, model, optimizer)
