"""litgpt's LoRA (``litgpt.lora.GPT`` with ``litgpt.lora.Config.from_name("Llama-3-8B")``, pip ``litgpt``), its own
classes unchanged, as its LoRA fine-tune trains it: ``mark_only_lora_as_trainable`` freezes every pretrained weight
(embedding, norms, every base ``linear``) and trains each ``lora_A`` / ``lora_B`` pair; rank 4, alpha 8, dropout off,
LoRA on the query, key, value (one fused ``LoRAQKVLinear``, whose B product runs as a grouped ``F.conv1d`` split by
q/k/v sizes), the attention projection, the SwiGLU MLP (``LLaMAMLP`` of ``LoRALinear``) and the head. ``lora_B`` is
drawn from a seeded normal (litgpt zeroes it) so every adapter weight trains from the first step. The Llama: dim 64,
4 query heads of 16, 2 key/value groups, 2 layers, an MLP of 128, vocabulary 128.
"""
import torch
from litgpt_common import (LIBRARY, VERSION, batch, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB

SOURCE = "litgpt/lora.py (GPT, CausalSelfAttention, LoRAQKVLinear, LoRALinear, LLaMAMLP), litgpt/model.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    torch.manual_seed(0)
    config = Config.from_name("Llama-3-8B", n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, head_size=HEAD_DIM,
                              n_query_groups=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                              padded_vocab_size=VOCAB, block_size=SEQ * 8, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                              lora_query=True, lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True,
                              lora_head=True)
    gpt = GPT(config)
    mark_only_lora_as_trainable(gpt)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return gpt
