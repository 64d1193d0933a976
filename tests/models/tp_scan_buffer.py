"""A gated recurrence for tensor parallelism, as RecurrentGemma's recurrent block writes one: a column-parallel
gate branch ``gelu(linear_y(x))`` times a scan branch whose linear is replicated (``tp_plan``), its output a
buffer (``zeros_like``) filled in place one position at a time, then a row-parallel ``linear_out``. The buffer is
whole on every rank and read at this rank's piece beside the gate: that read must come after the scan's writes
(made right after the buffer, it took a copy of zeros: 3e-2 from eager).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, W, BATCH, SEQ = 32, 16, 16, 4, 8


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.linear_y, self.linear_x, self.linear_out = nn.Linear(D, W), nn.Linear(D, W), nn.Linear(W, D)

    def forward(self, x):
        h = self.norm(x)
        y = F.gelu(self.linear_y(h))
        inputs = torch.tanh(self.linear_x(h))
        scanned = torch.zeros_like(inputs)
        state = torch.zeros_like(inputs[:, 0])
        for t in range(inputs.shape[1]):  # the scan: each position written into the buffer in place
            state = 0.5 * state + inputs[:, t]
            scanned[:, t] = state
        return x + self.linear_out(scanned * y)


tp_plan = {"*linear_x*": "replicate"}  # the scan stays whole, as its recurrence needs


model = model_of(VOCAB, D, Recurrent)
batch = token_batch(VOCAB, BATCH, SEQ, 900)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
