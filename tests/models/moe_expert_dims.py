"""``torchtitan_moe.py`` with its expert weights stored with the expert dim in three places: ``w3`` as torchtitan
stores it (``[experts, hidden, dim]``, expert dim 0), ``w2`` as ``[dim, experts, hidden]`` (dim 1) and ``w1`` as
``[dim, hidden, experts]`` (dim 2), each brought to ``[experts, in, out]`` for ``torch._grouped_mm`` by a permute
(and a ``contiguous`` where the kernel needs one of the last two dims dense).
Expert parallelism shards each on its own expert dim, and checkpoints hold them in this layout."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchtitan_moe as base
from torchtitan_moe import (D, EXPERTS, HIDDEN, batch, example_inputs, example_target, loss_fn,  # noqa: F401
                            optimizer, split_points)


class ExpertsAcrossDims(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.w1_DFE = nn.Parameter(torch.randn(D, HIDDEN, EXPERTS) * 0.1)
        self.w2_DEF = nn.Parameter(torch.randn(D, EXPERTS, HIDDEN) * 0.1)
        self.w3_EFD = nn.Parameter(torch.randn(EXPERTS, HIDDEN, D) * 0.1)

    def forward(self, x_RD, num_tokens_per_expert_E):
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x_RD.bfloat16(), self.w1_DFE.bfloat16().permute(2, 0, 1).contiguous(), offs=offs))
        h = h * torch._grouped_mm(x_RD.bfloat16(), self.w3_EFD.bfloat16().transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2_DEF.permute(1, 2, 0).bfloat16(), offs=offs).type_as(x_RD)


def model():
    net = base.model()
    torch.manual_seed(1)
    for layer in net.layers:
        layer.moe.routed_experts.inner_experts = ExpertsAcrossDims()
    return net
