"""Hugging Face families for context parallelism: a sequence of 16 tokens (``--cp 2`` cuts it in 4 chunks of 4,
``--cp 4`` in 8 of 2), hidden 32, 4 query heads and 2 key/value heads, 2 decoder layers, random weights, nothing
downloaded, dropout off. ``CP_HF_FAMILY`` picks the family (``FAMILIES``; ``llama`` by default) and
``CP_HF_ATTENTION`` the attention spelling (``sdpa`` by default, or ``eager``: ``matmul -> softmax -> matmul``
with an additive mask).

What each family brings to context parallelism: Llama (GQA, rotary positions made from ``cache_position``, the
causal mask built inside ``forward``), Qwen3 (q/k norms per head), Gemma3 (a sliding window of 5 tokens on the
first layer and global attention on the second: its mask is built from positions too), GPT-2 (learned absolute
positions: ``wpe(position_ids)``), Mixtral (routed experts: each rank routes its own tokens) and DeepSeek-V3
(MLA: keys from a compressed latent, a shared rotary key, keys written into a new buffer; group-limited routing).

The targets are next tokens with ``ignore_index`` (-100) padding, 5 positions per sample at a different place in
each (``CP_HF_PAD=0`` turns it off): with ``--cp`` the padding lands unevenly on the ranks (at cp 2 sample 0's
padding is 4 tokens on rank 0 and 1 on rank 1), so a mean over each rank's own tokens would differ from eager's.
Every sample has the same count, so the mean of any microbatch (or replica) is the batch's, as tracepp's
pipeline assumes. ``CP_HF_MASK=1`` (with ``CP_HF_PAD=0``) passes a ``[batch, seq]`` padding ``attention_mask`` instead
(each sample's last 3 positions, their targets ignored), from which the model builds its 4-D mask inside
``forward``.
"""
import os

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 64, 16, 4
LAYERS_COUNT = int(os.environ.get("CP_HF_LAYERS", "2"))  # deeper: the repeated-block checks
FAMILY = os.environ.get("CP_HF_FAMILY", "llama")
ATTENTION = os.environ.get("CP_HF_ATTENTION", "sdpa")
PAD = os.environ.get("CP_HF_PAD", "1") == "1"
MASK = os.environ.get("CP_HF_MASK", "0") == "1"  # pass a [batch, seq] attention_mask
FAMILIES = ("llama", "qwen3", "gemma3", "gpt2", "mixtral", "deepseek_v3")
LAYERS = {"gpt2": "transformer.h"}


def model():
    import transformers as t

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS_COUNT,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if FAMILY == "gpt2":
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0)
        built = t.GPT2LMHeadModel
    elif FAMILY == "mixtral":
        config = t.MixtralConfig(**common, head_dim=8, num_local_experts=4, num_experts_per_tok=2)
        built = t.MixtralForCausalLM
    elif FAMILY == "deepseek_v3":
        config = t.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS_COUNT,
            first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, max_position_embeddings=64,
            rope_scaling=None)
        built = t.DeepseekV3ForCausalLM
    elif FAMILY == "gemma3":
        config = t.Gemma3TextConfig(**common, head_dim=8, sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention"])
        built = t.Gemma3ForCausalLM
    elif FAMILY == "qwen3":
        config = t.Qwen3Config(**common, head_dim=8)
        built = t.Qwen3ForCausalLM
    elif FAMILY == "llama":
        config = t.LlamaConfig(**common)
        built = t.LlamaForCausalLM
    else:
        raise ValueError(f"CP_HF_FAMILY={FAMILY!r}: one of {', '.join(FAMILIES)}")
    config._attn_implementation = ATTENTION
    return built(config)


def batch(step):
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    ids, target = tokens[:, :-1], tokens[:, 1:].clone()
    if PAD:  # 5 padded positions per sample, starting at 11, 0, 6, 3: the same count in every sample (so any
        # microbatch or replica mean is the batch's) but spread unevenly over the cp ranks' chunks
        for sample, start in enumerate((11, 0, 6, 3)):
            target[sample, start:start + 5] = -100
    kwargs = {"use_cache": False}
    if MASK:  # a [batch, seq] padding mask (the model builds its 4-D mask from it): each sample's last 3 positions
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[:, -3:] = 0
        target[:, -3:] = -100
        kwargs["attention_mask"] = mask
    return (ids,), kwargs, target


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return batch(0)[1]


def example_target():
    return batch(0)[2]


def loss_fn(output, target):
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = [LAYERS.get(FAMILY, "model.layers") + ".1"]
