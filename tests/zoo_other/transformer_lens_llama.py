"""TransformerLens' own decoder (``transformer_lens.HookedTransformer`` built from ``HookedTransformerConfig``, pip
``transformer_lens`` 3.x; the class was removed in 4.0), its own components unchanged, configured as a Llama-style
decoder: pre-norm ``RMSNormPre``/``RMSNorm``, rotary positions, grouped-query attention (4 query heads, 2 key/value
heads: ``GroupedQueryAttention``), a SwiGLU MLP (``GatedMLP``, ``silu``), a final RMSNorm; d_model 64, heads of 16,
2 layers, an MLP of 128, vocabulary 128, context 64, random init (``init_weights``), nothing downloaded. Called as
``model(ids)``, whose default ``return_type="logits"`` gives logits ``[batch, seq, vocab]``.
"""
import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of,
                          ids_batch, sgd, version)

LIBRARY, VERSION = "transformer_lens", version("transformer_lens")
SOURCE = ("transformer_lens/{HookedTransformer,components/abstract_attention,components/grouped_query_attention,"
          "components/mlps/gated_mlp,components/rms_norm,components/rms_norm_pre}.py")
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        d_model=HIDDEN, d_head=HEAD_DIM, n_heads=HEADS, n_layers=LAYERS, d_mlp=FFN, d_vocab=VOCAB, n_ctx=SEQ * 8,
        act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
        n_key_value_heads=KV_HEADS, final_rms=True, original_architecture="LlamaForCausalLM", init_weights=True,
        seed=0, device="cpu", dtype=torch.float32)
    return HookedTransformer(cfg)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
