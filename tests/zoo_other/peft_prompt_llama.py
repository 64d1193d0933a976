"""PEFT's prompt tuning on a Hugging Face Llama (``peft.get_peft_model`` with a ``PromptTuningConfig``, task
``CAUSAL_LM``, pip ``peft``): the whole Llama frozen and only the soft prompt trained, a ``PromptEmbedding`` of 4
virtual tokens (``[4, 64]``, PEFT's random init, drawn from a normal: it trains from the first step), PEFT's own
``PeftModelForCausalLM.forward`` unchanged: the tokens' embeddings are computed by the frozen embedding and the
prompt's prepended along the sequence (``torch.cat((prompts, inputs_embeds), dim=1)``), so the Llama runs 12
positions and returns logits for all 12; the loss is the next-token loss of the last 8 (the virtual positions'
logits dropped, as PEFT's own labels of -100 for them would do). The Llama: dim 64, 4 query heads of 16, 2
key/value heads, 2 layers, an MLP of 128, vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, SEQ, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/peft_model.py (PeftModelForCausalLM.forward, get_prompt), peft/tuners/prompt_tuning/model.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
VIRTUAL_TOKENS = 4


def model():
    from peft import PromptTuningConfig, get_peft_model

    torch.manual_seed(0)
    prompt = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL_TOKENS)
    return get_peft_model(hf_llama(), prompt)


def loss_fn(output, target):
    """The next-token loss of the real tokens: the logits of the 4 virtual positions in front dropped."""
    return causal_lm_loss(output.logits[:, -SEQ:], target)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
optimizer = sgd
