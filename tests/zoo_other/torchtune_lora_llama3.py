"""torchtune's LoRA Llama 3 (``torchtune.models.llama3.lora_llama3``, the component builder every LoRA Llama 3 size
calls; pip ``torchtune`` 0.6.1), its own classes unchanged, as its LoRA recipes train it: ``set_trainable_params(model,
get_adapter_params(model))`` freezes the base (embedding, norms, every base weight) and trains each ``LoRALinear``'s
``lora_a`` / ``lora_b`` (``out = x @ W.T + (alpha / rank) * lora_b(lora_a(dropout(x)))``); rank 4, alpha 8, dropout
off, LoRA on q/k/v/output projections, the SwiGLU MLP (w1/w2/w3) and the output head. ``lora_b`` is drawn from a seeded
normal (torchtune zeroes it) so every adapter weight trains from the first step. The Llama: ``TransformerDecoder``,
``MultiHeadAttention`` with grouped-query attention, rotary positions, RMSNorm; dim 64, 4 query heads, 2 key/value
heads, 2 layers, an MLP of 128, vocabulary 128.
"""
import torch
from other_common import (FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "torchtune", version("torchtune")
SOURCE = "torchtune/models/llama3/_component_builders.py (lora_llama3), torchtune/modules/peft/{lora,_utils}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(0)
    decoder = lora_llama3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                          apply_lora_to_output=True, vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, embed_dim=HIDDEN, max_seq_len=SEQ * 8, intermediate_dim=FFN,
                          attn_dropout=0.0, lora_rank=4, lora_alpha=8, lora_dropout=0.0)
    set_trainable_params(decoder, get_adapter_params(decoder))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in decoder.named_parameters():
            if name.endswith("lora_b.weight"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return decoder


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
