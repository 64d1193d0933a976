"""lucidrains' Token Shift GPT (``token_shift_gpt.TokenShiftGPT``, pip ``token-shift-gpt``), its own classes
unchanged: an attention-free causal language model. A token embedding plus learned absolute positions
(``nn.Embedding(max_seq_len, dim)``), ``LAYERS`` residual blocks of ``FeedForward``: LayerNorm, ``project_in``
(``Linear(dim, dim * mult)`` + GELU) chunked into value and gate halves, the gate LayerNormed then token-shifted
(``shift_tokens``: ``cumsum`` over the sequence, the gate's first ``num_shifts`` feature chunks replaced by the mean
of the previous ``2**i`` .. ``2**(i+1)`` positions, as differences of the shifted cumulative sum (``F.pad`` with a
negative pad) divided by a shifted ``arange`` count), ``to_gate`` (``Linear``, initialised to weights 1e-3 and bias
1), value times gate and ``project_out``; a final LayerNorm and an untied head. dim 64, 2 layers, ff_mult 4 (halves
of 128), ``max_seq_len`` 8 (``num_shifts = ceil(log2(8)) - 1 = 2``), vocabulary 128. No attention.
"""
import torch
from other_common import HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from token_shift_gpt import TokenShiftGPT

LIBRARY, VERSION = "token-shift-gpt", version("token-shift-gpt")
SOURCE = "token_shift_gpt/token_shift_gpt.py (TokenShiftGPT, FeedForward, Residual, shift_tokens, shift)"
HEADS_, KV_HEADS_ = None, None  # no attention


def model():
    torch.manual_seed(0)
    return TokenShiftGPT(num_tokens=VOCAB, dim=HIDDEN, max_seq_len=SEQ, depth=LAYERS, ff_mult=4)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
