"""lucidrains' Mega language model (``mega_pytorch.Mega``, pip ``Mega-pytorch``), its own classes unchanged, causal
(``MegaLayer``'s ``causal=True``, its default): a token embedding, ``LAYERS`` post-LayerNorm blocks (``pre_norm=False``,
the library's default) of a ``MegaLayer`` and a GELU feed-forward (mult 2, biases). Each ``MegaLayer``: a
``MultiHeadedEMA`` (an expansion ``einsum('... d, h d -> ... h d')`` to 4 EMA heads, a damped exponential kernel
``alpha * ((1 - alpha) * delta) ** reversed_powers`` built from ``arange``, applied along the sequence by an FFT
convolution ``conv1d_fft``: ``torch.fft.rfft`` of input and kernel at ``scipy.fftpack.next_fast_len(2n - 1)``, a
complex product with the kernel's ``conj``, ``irfft``, ``roll(-1)`` and ``index_select`` of the last n; a reduction
``einsum('... h d, h d -> ... d')``), then a ``SingleHeadedAttention`` (queries/keys from the EMA output through
``Linear`` + SiLU and ``OffsetScale``, values from the layer input, a T5 relative position bias from an ``Embedding``
of bucketed distances, causal ``masked_fill`` and softmax), a SiLU reset gate, a sigmoid update gate and the
equation-14 ``silu(ema @ Wh + gated_attn @ Uh + bh)``; an untied head. dim 64, 2 layers, 4 EMA heads, attention
qk dim 16 and value dim 64 (single head), vocabulary 128.
"""
import torch
from other_common import HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from mega_pytorch import Mega

LIBRARY, VERSION = "Mega-pytorch", version("Mega-pytorch")
SOURCE = "mega_pytorch/mega_pytorch.py (Mega, MegaLayer, MultiHeadedEMA, conv1d_fft, SingleHeadedAttention, " \
         "T5RelativePositionBias, OffsetScale)"
HEADS_, KV_HEADS_ = 1, None  # one attention head (single-headed attention); EMA heads have no key/values


def model():
    torch.manual_seed(0)
    return Mega(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, ff_mult=2, ema_heads=4, attn_dim_qk=16,
                attn_dim_value=HIDDEN, laplacian_attn_fn=False, causal=True)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
