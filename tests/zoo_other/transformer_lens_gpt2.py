"""TransformerLens' own decoder (``transformer_lens.HookedTransformer`` built from ``HookedTransformerConfig``, pip
``transformer_lens`` 3.x; the class was removed in 4.0), its own components unchanged, configured as a GPT-2-style
decoder: pre-norm ``LayerNormPre``/``LayerNorm`` (``normalization_type="LN"``), learned absolute positions
(``PosEmbed``, ``positional_embedding_type="standard"``), multi-head attention (4 heads of 16: ``Attention``), an MLP
of ``gelu_new`` (``MLP``, not gated), a final LayerNorm; d_model 64, 2 layers, an MLP of 128, vocabulary 128,
context 64, random init (``init_weights``), nothing downloaded. Called as ``model(ids)``, whose default
``return_type="logits"`` gives logits ``[batch, seq, vocab]``.
"""
import torch
from other_common import (FFN, HEAD_DIM, HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch,
                          sgd, version)

LIBRARY, VERSION = "transformer_lens", version("transformer_lens")
SOURCE = ("transformer_lens/{HookedTransformer,components/abstract_attention,components/attention,components/mlps/mlp,"
          "components/layer_norm,components/layer_norm_pre,components/pos_embed}.py")
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention


def model():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    torch.manual_seed(0)
    cfg = HookedTransformerConfig(
        d_model=HIDDEN, d_head=HEAD_DIM, n_heads=HEADS, n_layers=LAYERS, d_mlp=FFN, d_vocab=VOCAB, n_ctx=SEQ * 8,
        act_fn="gelu_new", normalization_type="LN", positional_embedding_type="standard", gated_mlp=False,
        n_key_value_heads=None, original_architecture="GPT2LMHeadModel", init_weights=True, seed=0, device="cpu",
        dtype=torch.float32)
    return HookedTransformer(cfg)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
