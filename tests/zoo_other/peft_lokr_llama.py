"""PEFT's LoKr on a Hugging Face Llama (``peft.get_peft_model`` with a ``LoKrConfig`` on every projection, pip
``peft``): the pretrained weights frozen (embedding, norms, head and every base linear) and each projection's
Kronecker-product factors trained, PEFT's own ``lokr.layer.Linear`` (``LoKrLayer.forward``: ``result =
base_layer(x) + F.linear(x, delta)``, the delta weight rebuilt every forward as ``torch.kron(w1, w2_a @ w2_b) *
scaling`` reshaped to the base weight's shape) unchanged; rank 2 (below half of w2's factor, so w2 is the low-rank
``lokr_w2_a @ lokr_w2_b``; ``lokr_w1`` whole), alpha 4, rank and module dropout off, ``init_weights=False`` (every
factor drawn by kaiming-uniform, where PEFT's default starts ``lokr_w1`` at zero), so every adapter weight trains
from the first step. The Llama: dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, an MLP of 128,
vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/tuners/lokr/{model,layer}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model():
    from peft import LoKrConfig, get_peft_model

    torch.manual_seed(0)
    lokr = LoKrConfig(r=2, alpha=4, rank_dropout=0.0, module_dropout=0.0, init_weights=False, target_modules=TARGETS)
    return get_peft_model(hf_llama(), lokr)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
