"""PEFT's LoHa on a Hugging Face Llama (``peft.get_peft_model`` with a ``LoHaConfig`` on every projection, pip
``peft``): the pretrained weights frozen (embedding, norms, head and every base linear) and each projection's
Hadamard-product factors trained, PEFT's own ``loha.layer.Linear`` (``LoHaLayer.forward``: ``result = base_layer(x)
+ F.linear(x, delta)``, the delta weight rebuilt every forward as ``(w1_a @ w1_b) * (w2_a @ w2_b) * scaling``, through
PEFT's ``HadaWeight`` autograd function) unchanged; rank 4, alpha 8, rank and module dropout off,
``init_weights=False`` (every factor drawn by kaiming-uniform, where PEFT's default starts ``hada_w2_b`` at zero), so
every adapter weight trains from the first step. The Llama: dim 64, 4 query heads of 16, 2 key/value heads, 2
layers, an MLP of 128, vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/tuners/loha/{model,layer}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model():
    from peft import LoHaConfig, get_peft_model

    torch.manual_seed(0)
    loha = LoHaConfig(r=4, alpha=8, rank_dropout=0.0, module_dropout=0.0, init_weights=False, target_modules=TARGETS)
    return get_peft_model(hf_llama(), loha)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
