"""A Mamba-1 mixer for tensor parallelism, as transformers' slow path writes one: a column-parallel ``in_proj`` into
channels and a gate, a depthwise causal ``conv1d`` with a bias, ``x_proj`` row-parallel into the step size and the
state's B and C, ``dt_proj.weight @ dt`` with its bias added on its own (``bias[:, None]``), ``A = -exp(A_log)``
broadcast as ``A[None, :, None, :]``, a scan over time, the skip ``x * D[None, :, None]`` and a row-parallel
``out_proj``. ``A_log``, ``D``, the convolution's weight and bias and ``dt_proj``'s bias are read only at each
rank's channels: each rank holds its piece of them.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, INNER, STATE, RANK, KERNEL, BATCH, SEQ = 32, 16, 32, 4, 4, 3, 4, 6


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

    def initial_state(self, a, batch: int):
        return torch.zeros(batch, INNER, STATE)

    def forward(self, x):
        seq = x.shape[1]
        h, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [batch, channels, seq]
        h = F.silu(self.conv1d(h)[..., :seq])
        dt, b, c = torch.split(self.x_proj(h.transpose(1, 2)), [RANK, STATE, STATE], dim=-1)
        dt = F.softplus(self.dt_proj.weight @ dt.transpose(1, 2) + self.dt_proj.bias[:, None])  # [batch, ch, seq]
        a = -torch.exp(self.A_log.float())
        decay = torch.exp(a[None, :, None, :] * dt[:, :, :, None])  # [batch, channels, seq, state]
        inject = dt[:, :, :, None] * b[:, None, :, :].float()
        state = self.initial_state(a, x.shape[0])
        ys = []
        for t in range(seq):
            state = decay[:, :, t] * state + inject[:, :, t] * h[:, :, t, None]
            ys.append((state @ c[:, t, :, None]).squeeze(-1))
        y = torch.stack(ys, dim=-1) + h * self.D[None, :, None]
        return x + self.out_proj((y * F.silu(gate)).transpose(1, 2))


model = model_of(VOCAB, D, Mixer)
batch = token_batch(VOCAB, BATCH, SEQ, 1400)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
