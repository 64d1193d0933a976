"""Hugging Face families at tensor-parallel shapes: hidden 32, 4 query heads and 2 key/value heads (where the
family has grouped-query attention), 2 decoder layers, so ``--tp 2`` can shard every projection (the zoo's
other tiny configs have one key/value head, which tp 2 cannot split). ``TP_HF_FAMILY`` picks the family
(``FAMILIES``; ``qwen3`` by default); random weights, nothing downloaded, dropout off so training is exact.

The families cover the spellings of a decoder layer that tensor parallelism must read: separate q/k/v (Llama,
Qwen2 with biases, StarCoder2 with LayerNorm and a plain MLP), q/k norms over the whole projection (OLMo2) or
per head (Qwen3, Gemma3), a fused query_key_value split per head (GPT-NeoX) or per key/value group (Falcon's new
decoder, with parallel attention and MLP and ``x @ W.T`` linears), fused qkv_proj and gate_up_proj (Phi-3),
GPT-2's Conv1D (``addmm`` with a transposed weight) with its fused c_attn, and Mixtral's routed experts.
SGD, as the rest of the zoo: AdamW divides each gradient by its own running size, so an expert that saw no
token in a step (gradient ~1e-12 of rounding) would move by lr whatever the rounding was.
"""
import os

import torch
from zoo_common import causal_lm_batch, causal_lm_loss, examples_of, sgd

VOCAB = 64
FAMILY = os.environ.get("TP_HF_FAMILY", "qwen3")
FAMILIES = ("llama", "qwen2", "qwen3", "starcoder2", "olmo2", "gemma3", "gpt_neox", "phi3", "falcon", "gpt2",
            "mixtral")
LAYERS = {"gpt2": "transformer.h", "falcon": "transformer.h", "gpt_neox": "gpt_neox.layers"}


def model():
    import transformers as t

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if FAMILY == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if FAMILY == "falcon":
        return t.FalconForCausalLM(t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, num_kv_heads=2,
                                                  new_decoder_architecture=True))
    if FAMILY == "gpt_neox":
        common.pop("num_key_value_heads")
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**common))
    if FAMILY == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**common, head_dim=8, num_local_experts=4,
                                                    num_experts_per_tok=2))
    if FAMILY == "phi3":
        return t.Phi3ForCausalLM(t.Phi3Config(**common, pad_token_id=0))
    configs = {"llama": (t.LlamaConfig, t.LlamaForCausalLM), "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
               "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM), "olmo2": (t.Olmo2Config, t.Olmo2ForCausalLM),
               "starcoder2": (t.Starcoder2Config, t.Starcoder2ForCausalLM),
               "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM)}
    if FAMILY not in configs:
        raise ValueError(f"TP_HF_FAMILY={FAMILY!r}: one of {', '.join(FAMILIES)}")
    config, model_class = configs[FAMILY]
    extra = {"head_dim": 8} if FAMILY in ("qwen3", "gemma3") else {}
    return model_class(config(**common, **extra))


def batch(step):
    return causal_lm_batch(step, VOCAB)


example_inputs, example_kwargs, example_target = examples_of(batch)


loss_fn = causal_lm_loss
optimizer = sgd
split_points = [LAYERS.get(FAMILY, "model.layers") + ".1"]
