"""``torchtitan_moe.py`` with each expert's hidden activation RMS-normalized per row between its grouped matmuls
(``h * rsqrt(mean(h**2, -1) + eps)``: a reduction over the features, one row at a time). Expert parallelism places
the rows through it by the shared rules (a reduction over another dim than the rows carries them), where a list of
per-row ops refused it ("mean (aten::mean) runs between the expert matmuls and is not a per-row op")."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchtitan_moe as base
from torchtitan_moe import (D, EXPERTS, HIDDEN, batch, example_inputs, example_target, loss_fn,  # noqa: F401
                            optimizer, split_points)


class NormedExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = EXPERTS
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, D) * 0.1)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, D, HIDDEN) * 0.1)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, D) * 0.1)

    def forward(self, x, num_tokens_per_expert):
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def model():
    net = base.model()
    torch.manual_seed(1)
    for layer in net.layers:
        layer.moe.routed_experts.inner_experts = NormedExperts()
    return net
