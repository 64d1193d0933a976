"""litgpt's Gemma 3 (``litgpt.model.GPT`` with ``Config.from_name("Gemma-3-4b-it")``, pip ``litgpt``), its own classes
unchanged, at the tiny size: q/k RMSNorms per head (``norm_qk``, applied after the heads are split), local and global
rotary positions (one cos/sin cache of two columns, base 1e4 for local layers and 1e6, linearly scaled by
``rope_adjustments`` factor 8, for global ones; each block gets ``cos[..., rope_indices[i]]``), a sliding window of 4
tokens (shorter than the sequence of 8, so it masks) on the local layers, RMSNorm with a unit offset before and after
both attention and MLP, grouped-query attention (2 key/value groups, as Gemma-3-4B's 4 of 8) in one fused ``qkv``
projection, query scaling by ``attention_scores_scalar`` (the head size, 16), a tanh-GeGLU MLP (``GemmaMLP``),
embeddings scaled by sqrt(hidden), a head of its own. Gemma 3's five local layers to one global shrink to one local
then one global (``sliding_window_indices`` = ``rope_indices`` = [1, 0]); dim 64, 4 query heads of 16, 2 layers, an
MLP of 128, vocabulary 128.
"""
from litgpt_common import (LIBRARY, VERSION, batch, builder, example_inputs, example_kwargs,  # noqa: F401
                           example_target, loss_fn, optimizer)
from other_common import HEADS, HEAD_DIM, KV_HEADS, LAYERS

SOURCE = "litgpt/model.py (GPT, Block, CausalSelfAttention, GemmaMLP, RMSNorm, build_rope_cache), litgpt/config.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
WINDOW = 4
LOCAL = [1, 0] * (LAYERS // 2)

model = builder("Gemma-3-4b-it", n_query_groups=KV_HEADS, attention_scores_scalar=HEAD_DIM, sliding_window_size=WINDOW,
                sliding_window_indices=LOCAL, rope_indices=LOCAL)
