"""``tp_normalize_rmsnorm`` with NormFormer's norm inside the MLP (x-transformers' ``ff_post_act_ln``), spelled as
x-transformers' RMSNorm, ``F.normalize(x, dim=-1) * sqrt(dim) * g``: the gated hidden features, sharded over
``--tp`` by the column-wise ``fc_1``/``fc_2``, are normalised before the row-wise ``proj``. An L2 norm over a
sharded dim is not a sum of the ranks' norms (torch's ``_NormPartial``, whose ``reduce_op`` reads "sum"): read as
one, each rank's features would be scaled by the sum of the ranks' norms (the verification's injected fault).
``--tp 2`` must train equal to eager.
"""
import functools

import torch
import torch.nn.functional as F
from lib_style import FFN, Decoder, NormalizeRMSNorm, SeparateAttention, SwiGLU, D, loss_fn, sgd, token_batch  # noqa: F401

KV_HEADS = 2


class NormedSwiGLU(SwiGLU):
    def __init__(self):
        super().__init__()
        self.ffn_norm = NormalizeRMSNorm(FFN)

    def forward(self, x):
        return self.proj(self.ffn_norm(F.silu(self.fc_1(x)) * self.fc_2(x)))


def model():
    torch.manual_seed(0)
    return Decoder(2, functools.partial(NormalizeRMSNorm, D), functools.partial(SeparateAttention, KV_HEADS),
                   NormedSwiGLU)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
