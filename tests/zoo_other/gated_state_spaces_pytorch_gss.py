"""lucidrains' Gated State Spaces language model (``gated_state_spaces_pytorch.GatedStateSpacesLM``, pip
``gated-state-spaces-pytorch``), its own classes unchanged: a token embedding, 2 ``GSS`` layers (pseudocode 3.2 of
the paper: a LayerNorm, ``to_u`` = ``Linear(64, 128)`` + GELU and ``to_v`` = ``Linear(64, 64)`` + GELU without
biases, a ``DSS`` state-space layer on v, a gate ``to_gate`` (``Linear(64, 128)``), ``to_out`` of ``u * gate`` with
a bias, a residual through ``x.clone()``) and an untied head. Each ``DSS``: its own LayerNorm, a learned residual
``u * param_D``, a diagonal state-space kernel built from complex parameters made of real ones
(``Lambda = -exp(Lambda_real) + 1j * exp(Lambda_imag)``, ``C = C_real + 1j * C_imag``, ``[64, 16]`` each, then
``C * (exp(Lambda) - 1) / Lambda``), ``S = exp(Lambda * arange(seq))``, ``K = einsum('h n, n l -> l h', C, S).real``,
and a causal convolution by FFT along the sequence (``torch.fft.rfft`` of input and kernel at ``2 * seq``, their
product, ``irfft`` and the first ``seq`` positions). dim 64, expansion 2 (hidden 128), kernel N 16 and H 64,
vocabulary 128.
"""
import torch
from gated_state_spaces_pytorch import GatedStateSpacesLM
from other_common import HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "gated-state-spaces-pytorch", version("gated-state-spaces-pytorch")
SOURCE = "gated_state_spaces_pytorch/gss.py (GatedStateSpacesLM, GSS, DSS)"
HEADS_, KV_HEADS_ = None, None  # no attention: a state-space (FFT convolution) token mixer


def model():
    torch.manual_seed(0)
    return GatedStateSpacesLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, dim_expansion_factor=2, dss_kernel_N=16,
                              dss_kernel_H=HIDDEN)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
