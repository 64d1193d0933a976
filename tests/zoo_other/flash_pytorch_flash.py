"""lucidrains' FLASH language model (``flash_pytorch.FLASHTransformer``, pip ``FLASH-pytorch``), its own classes
unchanged, causal: the gated attention unit of "Transformer Quality in Linear Time" with its mixed-chunk attention.
A token embedding plus scaled sinusoidal absolute positions (``ScaledSinuEmbedding``), ``LAYERS`` ``FLASH`` blocks
(pre-``ScaleNorm``; token shift of half the features (``shift_tokens``, ``F.pad``); ``to_hidden`` (``Linear`` +
SiLU) chunked into value and gate; ``to_qk`` (``Linear`` + SiLU) to one shared query/key of ``query_key_dim``,
offset-scaled by ``OffsetScale`` into four (quadratic q/k, linear q/k: ``einsum`` then ``unbind``); partial rotary
positions (``rotary_embedding_torch``, ``min(32, query_key_dim)`` dims); the sequence grouped by ``group_size``:
within each group quadratic attention with a T5 relative position bias and the Laplace attention function
(``laplace_attn_fn``: ``torch.special.erf``), causally masked by ``masked_fill``; across groups causal linear
attention (per-group ``k^T v``, ``cumsum`` over groups, shifted one group by ``F.pad`` to be exclusive); the gate
times the sum, ``to_out`` and the residual), a final LayerNorm and an untied head. dim 64, 2 layers,
``query_key_dim`` 16, expansion factor 2, ``group_size`` 4 (2 groups in the 8 tokens, so both the quadratic and the
linear part run), vocabulary 128, attention dropout 0 (README settings otherwise: scalenorm, shift_tokens,
laplace_attn_fn).

FLASH is single-headed: one query/key of ``query_key_dim`` shared by every value feature (no heads to split).
"""
import torch
from other_common import HIDDEN, HEAD_DIM, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from flash_pytorch import FLASHTransformer

LIBRARY, VERSION = "FLASH-pytorch", version("FLASH-pytorch")
SOURCE = ("flash_pytorch/flash_pytorch.py (FLASHTransformer, FLASH, OffsetScale, ScaleNorm, ScaledSinuEmbedding, "
          "T5RelativePositionBias, LaplacianAttnFn), rotary_embedding_torch (RotaryEmbedding)")
HEADS_, KV_HEADS_ = 1, 1  # single-headed gated attention: one shared query/key


def model():
    torch.manual_seed(0)
    return FLASHTransformer(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, causal=True, group_size=4,
                            query_key_dim=HEAD_DIM, expansion_factor=2., attn_dropout=0., norm_type='scalenorm',
                            shift_tokens=True, laplace_attn_fn=True)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
