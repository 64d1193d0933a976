"""PEFT's AdaLoRA on a Hugging Face Llama (``peft.get_peft_model`` with an ``AdaLoraConfig`` on every projection,
pip ``peft``): the pretrained weights frozen (embedding, norms, head and every base linear) and each projection's SVD
triplet trained, the right and left singular vectors ``lora_A`` ``[r, in]`` / ``lora_B`` ``[out, r]`` and the
singular values ``lora_E`` ``[r, 1]``, PEFT's own ``SVDLinear.forward`` (``result += (x @ (lora_A * lora_E).T @
lora_B.T) * scaling / ranknum``, ``ranknum`` a frozen one-element parameter holding r) unchanged; initial rank 8,
alpha 16, dropout off. PEFT starts ``lora_E`` at zero: it is drawn from a normal here (seeded), so every adapter
weight trains from the first step. AdaLoRA's rank budget (``update_and_allocate``, which a training loop calls
between steps to mask ``lora_E``) and its orthogonal regulariser (added to ``outputs.loss`` only when the model is
given labels) are outside the forward traced here. The Llama: dim 64, 4 query heads of 16, 2 key/value heads, 2
layers, an MLP of 128, vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/tuners/adalora/{model,layer}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model():
    from peft import AdaLoraConfig, get_peft_model

    torch.manual_seed(0)
    adalora = AdaLoraConfig(init_r=8, target_r=4, lora_alpha=16, lora_dropout=0.0, total_step=100, tinit=10,
                            tfinal=20, target_modules=TARGETS)
    peft_model = get_peft_model(hf_llama(), adalora)
    with torch.no_grad():  # the singular values, zero in PEFT's init: drawn so that every factor trains
        for name, param in peft_model.named_parameters():
            if "lora_E" in name:
                param.normal_(0.0, 1.0)
    return peft_model


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
