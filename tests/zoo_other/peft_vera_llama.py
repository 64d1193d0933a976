"""PEFT's VeRA on a Hugging Face Llama (``peft.get_peft_model`` with a ``VeraConfig`` on every projection, pip
``peft``): the pretrained weights frozen (embedding, norms, head and every base linear), one pair of frozen random
projections ``vera_A`` ``[r, 128]`` / ``vera_B`` ``[128, r]`` shared by every adapted layer (buffers of the model,
each layer slicing the block it needs: ``vera_A[:, :in_features]``, ``vera_B[:out_features, :]``), and each
projection's scaling vectors ``vera_lambda_d`` ``[r]`` and ``vera_lambda_b`` ``[out_features]`` trained, PEFT's own
``vera.layer.Linear.forward`` (``result + lambda_b * F.linear(lambda_d * F.linear(x, sliced_A), sliced_B)``)
unchanged; rank 8, dropout off, ``init_weights=False`` (``lambda_b`` ones and ``lambda_d`` drawn from a normal,
where PEFT's default starts ``lambda_b`` at zero), so every adapter weight trains from the first step. The Llama:
dim 64, 4 query heads of 16, 2 key/value heads, 2 layers, an MLP of 128, vocabulary 128, ``use_cache=False``.
"""
import torch
from other_common import HEADS, KV_HEADS, causal_lm_loss, examples_of, hf_llama, ids_batch, sgd, version

LIBRARY, VERSION = "peft", version("peft")
SOURCE = "peft/tuners/vera/{model,layer}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model():
    from peft import VeraConfig, get_peft_model

    torch.manual_seed(0)
    vera = VeraConfig(r=8, target_modules=TARGETS, vera_dropout=0.0, projection_prng_key=0, init_weights=False)
    return get_peft_model(hf_llama(), vera)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
