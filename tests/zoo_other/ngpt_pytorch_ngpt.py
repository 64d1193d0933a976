"""lucidrains' nGPT, the normalized transformer (``nGPT_pytorch.nGPT``, pip ``nGPT-pytorch``), its own classes
unchanged: every projection a ``NormLinear`` whose weight is l2-normalised through ``torch.nn.utils.parametrize``
(``register_parametrization(linear, 'weight', L2Norm)``), the token embedding read as rows of such a normalised weight
(``token_embed.weight[ids]``), hidden states kept on the unit sphere by a learned-rate slerp-like residual
(``l2norm(residual.lerp(l2norm(out), alpha))``) instead of any LayerNorm/RMSNorm, separate q/k/v projections with
rotary positions (``rotary-embedding-torch``), l2-normalised queries and keys scaled by a learned per-channel
``Scale``, ``scaled_dot_product_attention`` inside an ``sdpa_kernel`` context, a value residual (layer 1's values
averaged into every later layer's, ``add_value_residual``), a SwiGLU feed-forward with learned hidden/gate scales,
and an untied, normalised ``to_logits`` with a learned logit scale; dim 64, 4 heads of 16, 2 layers,
ff_expand_factor 3 (inner 128), vocabulary 128.

Pinned to nGPT-pytorch 0.2.10, the last release whose modules are hashable: from 0.2.11 (``Attention.__eq__``,
``FeedForward.__eq__``) and in 0.2.16 (also ``nGPT.__eq__``, ``NormLinear.__eq__``, ``Scale.__eq__``, nGPT.py:82-507)
each defines ``__eq__`` without ``__hash__``, so Python sets ``__hash__ = None`` and ``nn.Module.named_modules``
(``memo.add(self)``) raises ``TypeError: unhashable type: 'nGPT'``: even ``model.parameters()`` fails. 0.2.10 differs
from 0.2.16 only by those methods and a ``return_hiddens`` option: the same model.
"""
import torch
from other_common import HEAD_DIM, HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from nGPT_pytorch import nGPT

LIBRARY, VERSION = "nGPT-pytorch", version("nGPT-pytorch")
SOURCE = "nGPT_pytorch/nGPT.py (nGPT, Attention, FeedForward, Residual, NormLinear, L2Norm, Scale)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # no grouped-query form


def model():
    torch.manual_seed(0)
    return nGPT(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_head=HEAD_DIM, heads=HEADS, ff_expand_factor=3.)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
