"""Issue 57: quantization-aware training with per-token asymmetric 8-bit activations, as torchao's fake quantizers
write it (``choose_qparams_affine``: each row's ``amin`` and ``amax`` over the features give a scale and a zero
point), weights per output channel symmetric, each rounded through a straight-through estimator written as code,
``x + (q(x) - x).detach()``.

Under tp a row-wise linear reads its input sharded on the features, the dim both reductions run over: each rank's
minimum and maximum are all-reduced (``tp_amax`` of ``x``, and of ``-x`` for the minimum), not the input gathered.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, mlp_of, model_of, token_batch

VOCAB, D, BATCH, SEQ = 32, 16, 4, 8


def fake_quant_tokens(x):
    low = torch.amin(x, dim=-1, keepdim=True).clamp(max=0)
    high = torch.amax(x, dim=-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / 255).clamp(min=1e-5)
    zero = (-128 - low / scale).round()
    q = ((x / scale).round() + zero).clamp(-128, 127)
    return x + ((q - zero) * scale - x).detach()


def fake_quant_channels(w):
    scale = (w.abs().max(dim=1, keepdim=True).values / 127).clamp(min=1e-5)
    return w + ((w / scale).round().clamp(-127, 127) * scale - w).detach()


class QuantLinear(nn.Linear):
    def forward(self, x):
        return F.linear(fake_quant_tokens(x), fake_quant_channels(self.weight), self.bias)


model = model_of(VOCAB, D, mlp_of(D, QuantLinear))  # x + down(gelu(up(norm(x))))
batch = token_batch(VOCAB, BATCH, SEQ, 2000)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
