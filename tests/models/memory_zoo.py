"""Hugging Face families sized so that activations weigh in a rank's peak, for the memory tests: the plan's
counted peak per rank against the peak measured in the run (``run.py --measure-memory``).

``MEMORY_FAMILY`` picks the family: ``llama`` (grouped-query attention: 4 query heads, 2 key/value heads),
``gpt2`` (Conv1D, learned positions, fused c_attn), ``mixtral`` (4 routed experts, top 2) or ``deepseek_v3``
(MLA attention, a dense first layer, 8 routed experts top 2 with a shared expert). Hidden 64, 4 decoder layers,
sequences of 32 tokens, a batch of 8: a microbatch routes enough (token, expert) pairs that random routing is
near balanced. Random weights, nothing downloaded, dropout off. No ``optimizer(params)``: the split's
``--optimizer`` (or run.py's) decides, so the tests choose SGD or AdamW.
"""
import os

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 128, 32, 8
FAMILY = os.environ.get("MEMORY_FAMILY", "llama")


def model():
    import transformers as t

    torch.manual_seed(0)
    if FAMILY == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=SEQ,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    if FAMILY == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common, attention_dropout=0.0))
    if FAMILY == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    if FAMILY == "deepseek_v3":
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, max_position_embeddings=SEQ, rope_scaling=None))
    raise ValueError(f"MEMORY_FAMILY={FAMILY!r}: one of llama, gpt2, mixtral, deepseek_v3")


def batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (tokens[:, :-1],), {"use_cache": False}, tokens[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return batch(0)[1]


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    return F.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))
