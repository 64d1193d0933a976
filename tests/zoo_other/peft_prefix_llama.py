"""PEFT's prefix tuning on a Hugging Face Llama (``peft.get_peft_model`` with a ``PrefixTuningConfig``, task
``CAUSAL_LM``, pip ``peft``): the whole Llama frozen and only the prefix trained, a ``PrefixEncoder`` embedding of 4
virtual tokens holding every layer's key and value prefix (``[4, layers * 2 * kv_heads * head_dim]``, drawn from a
normal, so it trains from the first step), PEFT's own ``PeftModelForCausalLM.forward`` unchanged: ``get_prompt``
views the embedding as ``[batch, 4, layers * 2, kv_heads, head_dim]``, permutes and splits it per layer into a
``DynamicCache`` passed as ``past_key_values``, so every attention layer attends to 4 learned key/value positions
before the 8 tokens (the tokens' positions start at 4); no prefix projection (``prefix_projection=False``). The
Llama: dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128, ``use_cache=False``.

The output holds that cache (``CausalLMOutputWithPast.past_key_values``: prefix and tokens' keys and values), a
``DynamicCache`` torch.export cannot flatten; transformers' own export helper
(``transformers.integrations.executorch.register_dynamic_cache_export_support``) registers it as a pytree, called
when this file is imported so that every rank that loads it can rebuild the output.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/peft_model.py (PeftModelForCausalLM.forward, get_prompt), peft/tuners/prefix_tuning/model.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
VIRTUAL_TOKENS = 4


def _register_cache():
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()


_register_cache()


def model():
    from peft import PrefixTuningConfig, get_peft_model

    torch.manual_seed(0)
    prefix = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL_TOKENS, prefix_projection=False)
    return get_peft_model(hf_llama(), prefix)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
