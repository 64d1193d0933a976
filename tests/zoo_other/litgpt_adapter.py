"""litgpt's LLaMA-Adapter (``litgpt.adapter.GPT`` with ``litgpt.adapter.Config.from_name("Llama-3-8B")``, pip
``litgpt``), its own classes unchanged, as its adapter fine-tune trains it: ``mark_only_adapter_as_trainable`` freezes
every pretrained weight and trains each layer's learned prefix (``adapter_wte``, an embedding of 4 prompt vectors run
through the layer's own fused ``qkv``, its keys and values ``repeat_interleave``d over the query heads) and its
per-head ``gating_factor`` (``y + gating_factor * attention(q, prefix k, prefix v)``); the adapter in every layer
(``adapter_start_layer=0``), the gates drawn from a seeded normal (litgpt zeroes them) so the prefix trains from the
first step. The Llama: dim 64, 4 query heads of 16, 2 key/value groups, 2 layers, an MLP of 128, vocabulary 128.
litgpt's ``CausalSelfAttention.scaled_dot_product_attention`` (``litgpt/adapter.py:87-104``) keeps the prefix's keys
and values, with their autograd graph, in ``adapter_kv_cache`` on the first forward and reuses them in every later
one (nothing in litgpt 0.5.13 clears it; Lightning-AI/litgpt issue 1287, open), so a second training step's backward fails ("Trying to backward through the
graph a second time") and the prefix would stop training: as a user training it must, a forward pre-hook on the
model clears each layer's cache before every forward (litgpt's classes unchanged).
``LITGPT_ADAPTER=adapter_v2`` builds ``litgpt.adapter_v2`` instead (``litgpt_adapter_v2.py``).
"""
import importlib
import os

import torch
from litgpt_common import (LIBRARY, VERSION, batch, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB

KIND = os.environ.get("LITGPT_ADAPTER", "adapter")
SOURCE = f"litgpt/{KIND}.py (GPT, CausalSelfAttention" + (", AdapterV2Linear, LLaMAMLP)" if KIND == "adapter_v2"
                                                          else ")") + ", litgpt/model.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    library = importlib.import_module(f"litgpt.{KIND}")
    torch.manual_seed(0)
    config = library.Config.from_name("Llama-3-8B", n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, head_size=HEAD_DIM,
                                      n_query_groups=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                                      padded_vocab_size=VOCAB, block_size=SEQ * 8, adapter_prompt_length=4,
                                      adapter_start_layer=0)
    gpt = library.GPT(config)
    getattr(library, "mark_only_adapter_v2_as_trainable" if KIND == "adapter_v2"
            else "mark_only_adapter_as_trainable")(gpt)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in gpt.named_parameters():
            if name.endswith("gating_factor"):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    def clear_prefix_cache(module, args):
        for block in module.transformer.h:
            if hasattr(block.attn, "adapter_kv_cache"):
                block.attn.adapter_kv_cache = None

    gpt.register_forward_pre_hook(clear_prefix_cache)
    return gpt
