"""PEFT's (IA)^3 on a Hugging Face Llama (``peft.get_peft_model`` with an ``IA3Config`` on every projection, pip
``peft``): the pretrained weights frozen (embedding, norms, head and every base linear) and each projection's learned
scaling vector ``ia3_l`` trained, PEFT's own ``IA3Layer``'s ``Linear.forward`` unchanged: on a feed-forward module
(``o_proj`` and ``down_proj`` here) it scales the layer's input, ``base_layer(x * ia3_l)`` (``ia3_l`` of
``[1, in_features]``), on the others its output, ``base_layer(x) * ia3_l`` (``ia3_l`` of ``[out_features, 1]``,
flattened). The vectors start at PEFT's own value, ones (nonzero, so every one trains from the first step). The
Llama: dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/tuners/ia3/{model,layer}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FEEDFORWARD = ["o_proj", "down_proj"]  # the row-parallel projections: their input (the sharded dim) is scaled


def model():
    from peft import IA3Config, get_peft_model

    torch.manual_seed(0)
    ia3 = IA3Config(target_modules=TARGETS, feedforward_modules=FEEDFORWARD)
    return get_peft_model(hf_llama(), ia3)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
