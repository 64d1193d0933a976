"""PEFT's LoRA on a Hugging Face Llama (``peft.get_peft_model`` with a ``LoraConfig`` on every projection, pip
``peft``): the model as a LoRA fine-tune trains it, the pretrained weights frozen (embedding, norms, head and every
base linear) and each projection's ``lora_A`` / ``lora_B`` pair trained, PEFT's own ``LoraLayer.forward``
(``result = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``) unchanged; rank 8, ``lora_B`` drawn from a normal
(``init_lora_weights="gaussian"``, so every adapter weight trains from the first step), dropout off. The Llama:
dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/tuners/lora/{model,layer}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights="gaussian", target_modules=TARGETS)
    return get_peft_model(hf_llama(), lora)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
