"""Hugging Face families sized so that activations weigh in a rank's peak, for the memory tests: the plan's
counted peak per rank against the peak measured in the run (``run.py --measure-memory``).

``MEMORY_FAMILY`` picks the family: ``llama`` (grouped-query attention: 4 query heads, 2 key/value heads),
``gpt2`` (Conv1D, learned positions, fused c_attn), ``mixtral`` (4 routed experts, top 2) or ``deepseek_v3``
(MLA attention, a dense first layer, 8 routed experts top 2 with a shared expert), and families no other test
names, for the independent meter's matrix (``benchmarks/memory_check.py``): ``granite`` (its embedding, residual,
attention and logit multipliers), ``glm`` (partial rotary, fused gate/up), ``helium``, ``seed_oss`` (biased
q/k/v) and ``olmoe`` (64 experts in its config, 8 here, top 2, q/k norms). Hidden 64, 4 decoder layers, sequences
of 32 tokens, a batch of 8, a vocabulary of 128 by default; ``MEMORY_HIDDEN`` and ``MEMORY_SEQ`` give a size where
activations weigh (hidden 256, 256 tokens: a microbatch's activations above the stage's weights and optimizer
state), ``MEMORY_VOCAB`` another vocabulary. A microbatch routes enough (token, expert) pairs that random routing is
near balanced. Random weights, nothing downloaded, dropout off. No ``optimizer(params)``: the split's
``--optimizer`` (or run.py's) decides, so the tests choose SGD or AdamW.
"""
import os

import torch
import torch.nn.functional as F

BATCH = 8
VOCAB = int(os.environ.get("MEMORY_VOCAB", "128"))
SEQ = int(os.environ.get("MEMORY_SEQ", "32"))
HIDDEN = int(os.environ.get("MEMORY_HIDDEN", "64"))
FAMILY = os.environ.get("MEMORY_FAMILY", "llama")
FAMILIES = ("llama", "gpt2", "mixtral", "deepseek_v3", "granite", "glm", "helium", "seed_oss", "olmoe")


def model():
    import transformers as t

    torch.manual_seed(0)
    if FAMILY == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=4, n_head=4, n_positions=SEQ,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    if FAMILY == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common, attention_dropout=0.0))
    if FAMILY == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    if FAMILY == "deepseek_v3":
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
            num_hidden_layers=4,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, max_position_embeddings=SEQ, rope_scaling=None))
    if FAMILY == "granite":
        return t.GraniteForCausalLM(t.GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                                                    attention_multiplier=0.0078125, logits_scaling=8.0))
    if FAMILY == "glm":
        return t.GlmForCausalLM(t.GlmConfig(**common, head_dim=HIDDEN // 4, partial_rotary_factor=0.5, pad_token_id=0,
                                            eos_token_id=1, bos_token_id=2))
    if FAMILY == "helium":
        return t.HeliumForCausalLM(t.HeliumConfig(**common, head_dim=HIDDEN // 4))
    if FAMILY == "seed_oss":
        return t.SeedOssForCausalLM(t.SeedOssConfig(**common, head_dim=HIDDEN // 4, attention_bias=True))
    if FAMILY == "olmoe":
        return t.OlmoeForCausalLM(t.OlmoeConfig(**dict(common, intermediate_size=HIDDEN // 2), num_experts=8,
                                                num_experts_per_tok=2))
    raise ValueError(f"MEMORY_FAMILY={FAMILY!r}: one of {', '.join(FAMILIES)}")


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
