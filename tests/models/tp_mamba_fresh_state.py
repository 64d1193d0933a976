"""A Mamba mixer whose scan makes its state from ``A`` itself, as transformers 5.25's Falcon-Mamba does in its
fallback scan: ``A.new_zeros(batch, channels, state)`` (a new tensor of the sizes it names, ``A`` giving only its
dtype and device; Falcon-Mamba's is left unused beside the loop, this one starts it). Under ``--tp 2`` the channels
shard (``in_proj`` column-wise, ``out_proj`` row-wise) and so do ``A_log``, ``D``, ``dt_proj`` and the conv: the
state is read at this rank's channels. The walk gathered ``A`` for ``new_zeros`` and kept ``A_log`` whole (Falcon-Mamba's
share of each layer went from 0.998 to 0.937 with transformers 5.25).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, model_of, token_batch

VOCAB, D, INNER, STATE, RANK, KERNEL, BATCH, SEQ = 32, 16, 32, 4, 4, 3, 4, 4


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D, 2 * INNER, bias=False)
        self.conv1d = nn.Conv1d(INNER, INNER, KERNEL, groups=INNER, padding=KERNEL - 1)
        self.x_proj = nn.Linear(INNER, RANK + 2 * STATE, bias=False)
        self.dt_proj = nn.Linear(RANK, INNER)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, STATE + 1, dtype=torch.float32)).repeat(INNER, 1))
        self.D = nn.Parameter(torch.ones(INNER))
        self.out_proj = nn.Linear(INNER, D, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        hidden, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        hidden = F.silu(self.conv1d(hidden)[..., :seq])
        dt, B, C = torch.split(self.x_proj(hidden.transpose(1, 2)), [RANK, STATE, STATE], dim=-1)
        dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)  # [b, d, s]
        A = -torch.exp(self.A_log.float())  # [d, n]
        decay = torch.exp(A[None, :, None, :] * dt[..., None])  # [b, d, s, n]
        inject = dt[..., None] * B[:, None] * hidden[..., None]
        state = A.new_zeros(batch, INNER, STATE)
        ys = []
        for i in range(seq):
            state = decay[:, :, i] * state + inject[:, :, i]
            ys.append((state @ C[:, i, :, None])[..., 0])
        y = (torch.stack(ys, dim=-1) + hidden * self.D[None, :, None]) * F.silu(gate)
        return x + self.out_proj(y.transpose(1, 2))


model = model_of(VOCAB, D, Mixer)
batch = token_batch(VOCAB, BATCH, SEQ, 1501)
example_inputs, example_target = examples_of(batch)


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
