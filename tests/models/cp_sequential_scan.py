"""Issue 57: Mamba's selective scan written as a Python loop over the positions, which the trace unrolls, under
``--cp``: a Mamba-1 mixer (a column-wise ``in_proj`` into channels and a gate, a depthwise causal ``conv1d``,
``x_proj`` into the step size and the state's B and C, ``A = -exp(A_log)``), its scan in one of two forms:

* ``SCAN=project`` (transformers' slow path, mamba-minimal): ``state = dA[:, :, t] * state + dBx[:, :, t]``, each
  step's output the state times that position's C, ``(state @ c[:, t, :, None]).squeeze(-1)``, stacked on the last
  dim;
* ``SCAN=stack`` (mambapy's ``selective_scan_seq``): ``h = deltaA[:, t] * h + BX[:, t]``, the states stacked on dim 1
  and multiplied by C after the loop.

Under ``--cp 2`` each rank runs the steps of its own positions, the state entering each of its chunks carried from
the chunks before it (``cp_linear_scan``); before, the loop's ``select``s had no rule and every rank ran the whole
scan on the whole sequence. Under ``--tp 2`` the channels are sharded through the loop.
"""
import os

import torch
import torch.nn.functional as F
import tp_selective_scan
from tiny_lm import examples_of, lm_loss, model_of, token_batch
from tp_selective_scan import BATCH, D, INNER, RANK, STATE, VOCAB

SEQ = 8  # (tp_selective_scan's 6 does not cut into 2 x cp = 4 chunks)
SCAN = os.environ.get("SCAN", "project")


class Mixer(tp_selective_scan.Mixer):  # its projections, convolution, A_log and D
    def forward(self, x):
        seq = x.shape[1]
        h, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # [batch, channels, seq]
        h = F.silu(self.conv1d(h)[..., :seq])
        dt, b, c = torch.split(self.x_proj(h.transpose(1, 2)), [RANK, STATE, STATE], dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # [batch, seq, channels]
        a = -torch.exp(self.A_log.float())
        if SCAN == "stack":
            y = self.scan_stacked(h.transpose(1, 2), dt, a, b, c)
        else:
            y = self.scan_projected(h, dt.transpose(1, 2), a, b, c)
        y = y + h * self.D[None, :, None]
        return x + self.out_proj((y * F.silu(gate)).transpose(1, 2))

    @staticmethod
    def scan_projected(h, dt, a, b, c):
        """transformers' MambaMixer.slow_forward: ``[batch, channels, seq]``, the state ``[batch, channels, state]``."""
        decay = torch.exp(a[None, :, None, :] * dt[:, :, :, None])  # [batch, channels, seq, state]
        inject = dt[:, :, :, None] * b[:, None, :, :] * h[:, :, :, None]
        state = torch.zeros(h.shape[0], INNER, STATE)
        ys = []
        for t in range(h.shape[2]):
            state = decay[:, :, t, :] * state + inject[:, :, t, :]
            ys.append((state @ c[:, t, :, None])[:, :, 0])
        return torch.stack(ys, dim=-1)

    @staticmethod
    def scan_stacked(x, delta, a, b, c):
        """mambapy's selective_scan_seq: ``x`` and ``delta`` ``[batch, seq, channels]``; returns ``[batch, channels,
        seq]``."""
        delta_a = torch.exp(delta.unsqueeze(-1) * a)  # [batch, seq, channels, state]
        bx = delta.unsqueeze(-1) * b.unsqueeze(2) * x.unsqueeze(-1)
        h = torch.zeros(x.size(0), INNER, STATE)
        hs = []
        for t in range(x.shape[1]):
            h = delta_a[:, t] * h + bx[:, t]
            hs.append(h)
        hs = torch.stack(hs, dim=1)  # [batch, seq, channels, state]
        return (hs @ c.unsqueeze(-1)).squeeze(3).transpose(1, 2)


model = model_of(VOCAB, D, Mixer)
batch = token_batch(VOCAB, BATCH, SEQ, 1500)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
