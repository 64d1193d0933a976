"""Issue 57: quantization-aware training as HF BitNet writes it (transformers' ``integrations/bitnet.py``,
``AutoBitLinear`` in online mode): each linear's weight quantized to ternary values by ``WeightQuant`` and its input
to 8 bits per row by ``ActQuant``, each a ``torch.autograd.Function`` whose forward rounds (derivative zero) and whose
backward passes the gradient through unchanged: straight-through estimators.

torch.export keeps the forward only: split, the rounds' zero derivative would have stopped every gradient, with only a
note. tracepp finds each call's backward passing its output's gradient to its input unchanged, traces the Function as
``x + (f(x) - x).detach()`` and checks one eager step each way (``tracepp/custom_functions.py``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, mlp_of, model_of, token_batch

VOCAB, D, BATCH, SEQ = 32, 16, 4, 8


class WeightQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight):
        dtype = weight.dtype
        weight = weight.float()
        scale = 1.0 / weight.abs().mean().clamp_(min=1e-5)
        return ((weight * scale).round().clamp(-1, 1) / scale).to(dtype)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone()


class ActQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation):
        dtype = activation.dtype
        activation = activation.float()
        scale = 127 / activation.abs().max(dim=-1, keepdim=True).values.clamp_(min=1e-5)
        return ((activation * scale).round().clamp(-128, 127) / scale).to(dtype)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone()


class BitLinear(nn.Linear):
    def forward(self, x):
        return F.linear(ActQuant.apply(x), WeightQuant.apply(self.weight), self.bias)


model = model_of(VOCAB, D, mlp_of(D, BitLinear))  # x + down(gelu(up(norm(x))))
batch = token_batch(VOCAB, BATCH, SEQ, 2000)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
