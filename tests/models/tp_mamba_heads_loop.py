"""A Mamba mixer split into heads that are scanned one by one, as transformers' Zamba writes it
(``modeling_zamba.py``, ``ZambaMambaMixer.slow_forward``): ``in_proj`` viewed ``[b, channels, 2, s]`` into the
channels and the gate, a depthwise causal ``conv1d``, then per-head weights (``x_proj_weight[:, None] @ x``,
``dt_proj_weight[:, None] @ dt``, ``A_log``, ``D``, ``dt_proj_bias``, each ``[heads, ...]``) and ``for head_idx in
range(n_mamba_heads)`` a selective scan of ``x[head_idx]``, ``dt[head_idx]``, ``A[head_idx]``, ``B[head_idx]``,
``C[head_idx]``, ``D[head_idx]``, ``gate[head_idx]``, joined by ``torch.cat(scan_outputs, dim=1)`` before a row-parallel
``out_proj``. The scan itself loops over time (4 steps, as many as heads: a loop inside each head's ops).

Under ``--tp 2`` each rank runs the scans of its own 2 heads (``split/tp_head_loop.py``) and holds its heads' rows
of every per-head weight; the heads were gathered and every rank scanned all 4.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, model_of, token_batch

VOCAB, D, HEADS, HEAD_DIM, STATE, RANK, KERNEL, BATCH, SEQ = 32, 16, 4, 8, 4, 4, 3, 4, 4
INNER = HEADS * HEAD_DIM


def selective_scan(u, delta, A, B, C, D, z, delta_bias):
    """One head: u, delta, z ``[b, d, s]``, A ``[d, n]``, B and C ``[b, n, s]``, D and delta_bias ``[d]``."""
    delta = F.softplus(delta + delta_bias[..., None].float())
    decay = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    inject = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    state = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        state = decay[:, :, i] * state + inject[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", state, C[:, :, i]))
    y = torch.stack(ys, dim=2) + u * D[None, :, None]
    return y * F.silu(z)


class HeadsMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D, 2 * INNER, bias=False)
        self.conv1d = nn.Conv1d(INNER, INNER, KERNEL, groups=INNER, padding=KERNEL - 1)
        self.x_proj_weight = nn.Parameter(torch.randn(HEADS, RANK + 2 * STATE, HEAD_DIM) / HEAD_DIM ** 0.5)
        self.dt_proj_weight = nn.Parameter(torch.randn(HEADS, HEAD_DIM, RANK) / RANK ** 0.5)
        self.dt_proj_bias = nn.Parameter(torch.rand(HEADS, HEAD_DIM) * 0.1)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, STATE + 1, dtype=torch.float32)).repeat(HEADS, HEAD_DIM, 1))
        self.D = nn.Parameter(torch.ones(HEADS, HEAD_DIM))
        self.out_proj = nn.Linear(INNER, D, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        projected = self.in_proj(x).transpose(1, 2)
        hidden, gate = projected.view(batch, -1, 2, seq).chunk(2, dim=2)
        hidden = hidden.squeeze(2).contiguous()
        gate = gate.reshape(batch, HEADS, HEAD_DIM, seq).transpose(0, 1)
        hidden = F.silu(self.conv1d(hidden)[..., :seq])
        hidden = hidden.reshape(batch, HEADS, HEAD_DIM, seq).transpose(0, 1)
        ssm = (self.x_proj_weight[:, None] @ hidden).transpose(-1, -2)
        dt, B, C = torch.split(ssm, [RANK, STATE, STATE], dim=-1)
        dt = self.dt_proj_weight[:, None] @ dt.transpose(-1, -2)
        A = -torch.exp(self.A_log.float())
        outs = []
        for head in range(HEADS):
            outs.append(selective_scan(hidden[head], dt[head], A[head], B[head].transpose(1, 2),
                                       C[head].transpose(1, 2), self.D[head].float(), gate[head],
                                       self.dt_proj_bias[head]))
        y = torch.cat(outs, dim=1)
        return x + self.out_proj(y.transpose(1, 2))


model = model_of(VOCAB, D, HeadsMixer)
batch = token_batch(VOCAB, BATCH, SEQ, 1500)
example_inputs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
