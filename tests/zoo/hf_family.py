"""Any causal-LM family transformers ships, at a tiny size: ``HF_FAMILY`` names an entry of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``llama``, ``gpt_oss``, ...). The config is the family's own config class
with its defaults, shrunk by what each setting means (``tiny_config``): hidden 64, 2 to 4 layers (enough to
hold every kind of layer the family interleaves), 4 query heads of 16, 2 key/value heads where the family has
grouped-query attention (a multi-query family keeps its one), 4 routed experts top-2 where it has experts, a
vocabulary of 128, every dropout off. Random weights, nothing downloaded.

``benchmarks/studies/families.py`` runs every family through tracepp with this file; ``tests/test_families.py``
trains a rotating few.
"""
import inspect
import os

import torch
from zoo_common import causal_lm_loss, sgd, token_batch

VOCAB = 128
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 4, 2, 16, 2
LAYERS = int(os.environ.get("HF_LAYERS", LAYERS))  # deeper: the repeated-block checks (tests/test_blocks.py)
FAMILY = os.environ.get("HF_FAMILY", "llama")

# what a config setting means -> its tiny value (names as transformers' configs spell them)
_HIDDEN = ("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "dim", "n_embed", "word_embed_proj_dim",
           "embedding_size", "hidden_dim", "hidden_size_global", "emb_dim",
           "backbone_hidden_size")  # a drafter's (Gemma 4 assistant's): the hidden size of the model it drafts for
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
          "encoder_attention_heads", "attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "kv_n_heads",
             "num_key_value_groups")
_HEAD_DIMS = {"head_dim": HEAD_DIM, "attention_head_size": HEAD_DIM, "kv_channels": HEAD_DIM,
              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM, "q_lora_rank": 32,
              "kv_lora_rank": 16, "index_head_dim": 16, "index_n_heads": 2, "qk_head_dim": 16,
              "index_num_heads": 2}
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "inner_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
        "encoder_ffn_dim", "ffn_hidden_dim", "mlp_dim", "ff_dim", "dim_ff", "dff", "intermediate_size_mlp")
_MOE_FFN = ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
            "moe_ffn_hidden_size", "expert_hidden_size", "moe_hidden_size", "ffn_dim_moe", "expert_ffn_hidden_size")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
            "num_local_expert")
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "moe_k", "num_selected_experts")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
              "seq_length", "max_length")
EXPERTS, TOP_K = 4, 2
# the sizes of linear-attention, state-space and recurrent mixers (hybrid families): 8 Mamba heads of 16 (their
# product is expand x hidden), 2 key and 4 value heads of 16 for gated delta-nets, a state of 16
_MIXER = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_num_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_head_dim": 16, "mamba_n_heads": 8, "n_mamba_heads": 8,
          "mamba_num_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_headdim": 16, "mamba_d_ssm": 128,
          "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "time_step_rank": 8, "lru_width": 64,
          "attention_head_dim": 16}
# per-layer inputs (Gemma 3n, Gemma 4): a second embedding table, of this vocabulary, of this width per layer; a
# drafter's (Gemma 4 assistant's) clusters of the vocabulary (128 tokens: 8 of 16) and how many it scores;
# LongCat-Flash's identity ("zero") experts beside its routed ones (512 routed and 256 zero: 4 and 2)
_OTHER = {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "num_centroids": 8,
          "centroid_intermediate_top_k": 2, "zero_expert_num": EXPERTS // 2}

# families whose tiny config needs more than the rules above: the setting and why
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
OVERRIDES = {
    "deepseek_v2": {"rope_scaling": None},
    "deepseek_v3": {"rope_scaling": None},
    # its default attention config has no rope_theta, and no clip_qkv (a clamp to None, which torch refuses: the
    # released DBRX clips q/k/v at 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # its default rope_parameters are empty, and the model reads one per layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    "stablelm": {"qk_layernorm": True},  # its per-head q/k LayerNorms (a ModuleList), off by default
    # its default has no layer types (the model reads one per layer) and its first 2 layers dense: a conv layer,
    # an attention layer, then a mixture-of-experts layer
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
    # its default makes every layer attention: a short-convolution layer and an attention layer, as LFM2 interleaves
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "mamba2": {"head_dim": 32, "n_groups": 1},  # heads x head_dim must equal expand x hidden; groups divide heads
    # its shared transformer is tied across its hybrid layers: two of them
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # its causal LM asks for is_decoder; its axial position embeddings must sum to the hidden size and their
    # shape multiply to the sequence length (8) when training
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [2, 4]},
    # its default leaves the indexed attention's indexer unset (a division by None when built)
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
    # its saved form interleaves an "mlp" entry after each layer and doubles the layer counts (the config halves
    # them back), and its layers split into input, recurrent (looped) and output blocks whose counts must sum to
    # the depth: one layer of each, sliding / full / sliding attention (its default has full attention every 4th)
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    "blt": {"encoder_hash_byte_group_vocab": 256},  # 500002 rows of byte-group hash embeddings by default
    # its weights start at std 1.0 (a loss of 20): 3 SGD steps at lr 0.1 then diverge, and eager against eager
    # (float32 against float64, a batch whole against 2 microbatches) differs by 2.1 and 0.013, so no comparison
    # can pass; at the usual 0.02 it trains as the others do
    "cpmant": {"init_std": 0.02},
    # its default config has one expert (the released Hunyuan-A13B routes among 64, 8 per token): 4, top-2
    "hunyuan_v1_moe": {"num_experts": EXPERTS, "moe_topk": TOP_K},
    "musicgen_decoder": {"num_codebooks": 1},  # one codebook: a sample is one row of tokens
    "musicgen_melody_decoder": {"num_codebooks": 1},
}


# families whose own default config fails its own validation: the settings it is built with before shrinking
DEFAULTS = {
    # a drafter for Gemma 4 (Gemma4AssistantConfig): its default text config is Gemma 4's, with per-layer inputs
    # it refuses (the released assistants have none)
    "gemma4_assistant": {"text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0,
                                         "vocab_size_per_layer_input": 0}},
}


def _per_layer(value, default_layers):
    """A per-layer list of the family's default depth (``layer_types``): the shortest prefix (2 to 4 layers) that
    holds every kind of layer it interleaves, or None when it is not one."""
    if not isinstance(value, (list, tuple)) or not default_layers or len(value) != default_layers:
        return None
    kinds = []
    for index, kind in enumerate(value):
        if repr(kind) not in kinds:
            kinds.append(repr(kind))
    if len(kinds) > 4:  # not kinds of layer (LFM2's full_attn_idxs: the indices of its attention layers)
        return None
    want = set(kinds)
    for end in range(2, min(4, len(value)) + 1):
        if {repr(k) for k in value[:end]} == want:
            return list(value[:end])
    firsts = [value[[repr(v) for v in value].index(kind)] for kind in kinds]  # one of each kind, in order
    return firsts if len(firsts) >= 2 else list(value[:min(4, len(value))])


def tiny_config(config_class):
    """The family's own config with every size setting shrunk by what it means (the rules above)."""
    defaults = DEFAULTS.get(config_class.model_type, {})
    values = _shrink(config_class(**defaults).to_dict())
    for key, value in defaults.items():  # under what the rules shrank (a sub-config's settings they left are absent)
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = dict(value, **values[key])
        else:
            values.setdefault(key, value)
    for key, value in OVERRIDES.get(config_class.model_type, {}).items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = dict(values[key], **value)
        else:
            values[key] = value
    return config_class(**values)


def _shrink(values: dict) -> dict:
    """The settings of one config (or of a sub-config given as a dict: DBRX's ``attn_config``) that the rules
    shrink; the others are left to the config's defaults."""
    out = {}
    layers_default = _default_layers(values)
    layers = LAYERS
    lists = {}
    for key, value in values.items():
        found = _per_layer(value, layers_default)
        if found is not None:
            lists[key] = found
    if lists:
        layers = max(len(v) for v in lists.values())
    if lists and values.get("num_kv_shared_layers") and values["num_kv_shared_layers"] != layers_default:
        # Gemma 3n: the last layers reuse the caches of the first (a drafter's every layer does: kept so)
        lists = {key: found + found for key, found in lists.items()}
        layers *= 2
    has_experts = any((isinstance(values.get(k), int) and values[k] > 1) or (k in values and values[k] is None
                                                                             and any(t in values for t in _TOP_K))
                      for k in _EXPERTS)
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = _shrink(value)
            continue
        if key == "per_layer_config" and isinstance(value, dict):  # DOTS3: settings per layer, shrunk alike
            out[key] = {layer: _shrink(entry) for layer, entry in value.items()
                        if not layer.isdigit() or int(layer) < (layers_default or 0)}
            continue
        if isinstance(value, bool) or isinstance(value, dict):
            continue
        if key in lists:
            found = lists[key][:layers] + [lists[key][-1]] * (layers - len(lists[key]))
            # a size given per layer (Gemma 3n's intermediate_size) is shrunk layer by layer, as the size it is
            shrunk = [_tiny(key, item, values, layers, has_experts) for item in found]
            out[key] = [item if new is _KEEP else new for item, new in zip(found, shrunk)]
            continue
        new = _tiny(key, value, values, layers, has_experts)
        if new is not _KEEP:
            out[key] = new
    return out


def _default_layers(values: dict):
    return next((values[k] for k in _LAYERS if isinstance(values.get(k), int)), None)


_KEEP = object()  # no rule shrinks the setting: the config's default stays


def _tiny(key, value, values: dict, layers: int, has_experts: bool):
    """The tiny value of one setting (``values``: the settings of its config), or ``_KEEP``."""
    if isinstance(value, bool):
        return _KEEP
    if key in _TOP_K and value is None and has_experts:
        return TOP_K
    if key in _EXPERTS and value is None and any(k in values for k in _TOP_K):
        return EXPERTS  # a family whose default leaves its expert count unset (DOTS1)
    if key in _KV_HEADS and value is None and key != "num_key_value_groups":
        return HEADS if values.get("kv_lora_rank") else KV_HEADS  # unset: one per query head by default
    if key in ("n_shared_experts", "num_shared_experts") and value is None and has_experts:
        return 1  # unset where the family multiplies by it (DOTS1)
    if key == "head_dim" and value is None and not values.get("kv_lora_rank"):
        return HEAD_DIM  # unset, and read as it is by some families (Ministral)
    if not isinstance(value, (int, float)) or value is None:
        return _KEEP
    if key in _MIXER and isinstance(value, int):
        return _MIXER[key]
    if key in _OTHER and isinstance(value, int) and value > 0:  # 0: the family has none (kept so)
        return _OTHER[key]
    if key in _HIDDEN and isinstance(value, int):
        return HIDDEN
    if key in _LAYERS:
        return layers
    if key in _HEADS:
        return HEADS
    if key in _KV_HEADS and values.get("kv_lora_rank"):  # latent attention: a key and value per head
        return HEADS
    if key in _KV_HEADS:
        return value if value == 1 and key != "num_key_value_groups" else KV_HEADS
    if key == "head_dim" and isinstance(value, int) and value == values.get("qk_rope_head_dim"):
        return _HEAD_DIMS["qk_rope_head_dim"]  # multi-head latent attention: the rotary part's width
    if key in _HEAD_DIMS and isinstance(value, int):
        return _HEAD_DIMS[key]
    if key in ("rotary_dim", "rotary_emb_dim", "rope_dim") and isinstance(value, int) and value > 8:
        return 8
    if key in _FFN and isinstance(value, int):
        return 2 * HIDDEN
    if key in _MOE_FFN and isinstance(value, int):
        return 32
    if key.endswith("intermediate_size") and isinstance(value, int) and value > 2 * HIDDEN:
        return 32 if any(w in key for w in ("expert", "moe", "shared")) else 2 * HIDDEN  # any other MLP
    if key in _EXPERTS and isinstance(value, int) and value > 1:
        return EXPERTS
    if key in _TOP_K and isinstance(value, int) and value > 1:
        return TOP_K
    if key in ("n_shared_experts", "num_shared_experts") and value:
        return 1
    if key == "num_kv_shared_layers" and value:
        return layers if value == _default_layers(values) else layers // 2
    if key in ("n_group", "num_expert_group") and value and value > 1:
        return 2
    if key in ("topk_group", "topk_groups") and value and value > 1:
        return 1
    if key in ("first_k_dense_replace", "first_k_dense") and value:
        return 1
    if key in ("vocab_size", "unpadded_vocab_size", "shape_vocab_size", "pronunciation_vocab_size"):
        return VOCAB
    if key in _POSITIONS and isinstance(value, int) and value > 64:
        return 64
    if key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
        return VOCAB - 1
    if ("dropout" in key or "pdrop" in key or key.endswith("_drop") or key in ("drop_rate",)) \
            and isinstance(value, float):
        return 0.0
    return _KEEP


def model_class(family: str = FAMILY):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])


def config(family: str = FAMILY):
    """The tiny config of the class the causal LM takes (a composite family's text or decoder config: Llama 4's
    ``Llama4TextConfig``, MusicGen's decoder), else the family's own."""
    import transformers

    own = transformers.CONFIG_MAPPING[family]
    takes = getattr(model_class(family), "config_class", None) or own
    return tiny_config(takes if isinstance(takes, type) and takes is not own else own)


# what a family's model file does after building it, as its own docs say (the step and why)
AFTER_BUILD = {
    "xmod": lambda m: m.set_default_language("en_XX"),  # its adapters are per language: pick the default one
}


# modules whose training forward samples (tracepp names each op that draws random numbers, e.g. PhiMoE's
# sparsemixer: aten.exponential_ for Gumbel sampling of its routes): held in eval mode, their deterministic branch,
# so that eager and pipelined training can be compared number for number (a module name's last part)
HELD_IN_EVAL = {"phimoe": ("router",)}


def _hold_in_eval(module: torch.nn.Module) -> None:
    module.train(False)
    module.train = lambda mode=True: torch.nn.Module.train(module, False)  # model.train() leaves it in eval


def model(hold: bool = True):
    """The family's model; ``hold=False`` keeps the modules of ``HELD_IN_EVAL`` as the family builds them."""
    torch.manual_seed(0)
    built = model_class()(config())
    if FAMILY in AFTER_BUILD:
        AFTER_BUILD[FAMILY](built)
    for name, module in built.named_modules():
        if hold and name.rsplit(".", 1)[-1] in HELD_IN_EVAL.get(FAMILY, ()):
            _hold_in_eval(module)
    return built


def _takes_use_cache() -> bool:
    forward = inspect.signature(model_class().forward).parameters
    return "use_cache" in forward or any(p.kind is p.VAR_KEYWORD for p in forward.values())


def batch(step):
    ids, target = token_batch(step, VOCAB)
    return (ids,), ({"use_cache": False} if _takes_use_cache() else {}), target


def example_inputs():
    return batch(0)[0]


def example_kwargs():
    return batch(0)[1]


def example_target():
    return batch(0)[2]


loss_fn = causal_lm_loss
optimizer = sgd
