"""litgpt's Gemma 2 (``litgpt.model.GPT`` with ``Config.from_name("Gemma-2-2b")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: attention-logit softcapping (50, so attention runs as explicit ``q @ k.mT``, tanh and
softmax, not SDPA), final-logit softcapping (30), a sliding window of 4 tokens (shorter than the sequence of 8, so it
masks) on the first of every two layers (``sliding_window_indices`` [1, 0]), RMSNorm with a unit offset before and
after both attention and MLP (``post_attention_norm``, ``post_mlp_norm``), grouped-query attention (2 key/value groups)
in one fused ``qkv`` projection, query scaling by ``attention_scores_scalar`` (the head size, 16, as Gemma-2-2B's 256
is its head size), a tanh-GeGLU MLP (``GemmaMLP``), embeddings scaled by sqrt(hidden), a head of its own
(litgpt's ``GPT`` keeps ``lm_head`` apart from ``wte``; its checkpoint converter copies Gemma's tied embedding into
it); dim 64, 4 query heads of 16, 2 layers, an MLP of 128, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS, HEAD_DIM, KV_HEADS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GemmaMLP, do_softcapping), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
WINDOW = 4

model = builder("Gemma-2-2b", n_query_groups=KV_HEADS, attention_scores_scalar=HEAD_DIM, sliding_window_size=WINDOW)
