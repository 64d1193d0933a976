"""Issue 57: reversible residual layers as reformer-pytorch, h-transformer-1d and RevTorch write them (and HF Reformer,
with its own names): the hidden state duplicated into two streams, each block ``y1 = x1 + f(x2)``, ``y2 = x2 +
g(y1)`` run under ``torch.no_grad()`` inside a ``torch.autograd.Function`` whose backward recomputes each block's
input from its output (``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``) and its gradients with the layers run again, so no
block keeps an activation; the streams summed at the end.

torch.export keeps the Function's forward only, where the layers run without gradients: split, they would never
train. tracepp runs one eager step with the Function's backward and one with its forward recorded by autograd,
finds the gradients equal, and traces the forward again with the layers recorded (``tracepp/custom_functions.py``).
``f`` is causal attention over 2 heads, ``g`` a feed-forward, each after a LayerNorm.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_lm import examples_of, lm_loss, model_of, token_batch

VOCAB, D, HEADS, BATCH, SEQ = 32, 16, 2, 4, 8
HALF = D  # each stream is as wide as the embedding: the embedding duplicated, as reformer-pytorch does


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HALF)
        self.qkv = nn.Linear(HALF, 3 * HALF)
        self.out = nn.Linear(HALF, HALF)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, HALF // HEADS).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, HALF))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(HALF), nn.Linear(HALF, 2 * HALF), nn.GELU(), nn.Linear(2 * HALF, HALF))

    def forward(self, x):
        return self.net(x)


class ReversibleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = Attention(), FeedForward()

    def forward(self, x):
        x1, x2 = torch.chunk(x, 2, dim=2)
        with torch.no_grad():
            y1 = x1 + self.f(x2)
            y2 = x2 + self.g(y1)
        return torch.cat([y1, y2], dim=2)

    def backward_pass(self, y, dy):
        y1, y2 = torch.chunk(y, 2, dim=2)
        dy1, dy2 = torch.chunk(dy, 2, dim=2)
        with torch.enable_grad():
            y1.requires_grad = True
            gy1 = self.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
            y1.grad = None
        with torch.enable_grad():
            x2.requires_grad = True
            fx2 = self.f(x2)
            torch.autograd.backward(fx2, dx1)
        with torch.no_grad():
            x1 = y1 - fx2
            dx2 = dy2 + x2.grad
            x2.grad = None
            return torch.cat([x1, x2.detach()], dim=2), torch.cat([dx1, dx2], dim=2)


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, blocks):
        for block in blocks:
            x = block(x)
        ctx.y, ctx.blocks = x.detach(), blocks
        return x

    @staticmethod
    def backward(ctx, dy):
        y = ctx.y
        for block in ctx.blocks[::-1]:
            y, dy = block.backward_pass(y, dy)
        return dy, None


class ReversibleStack(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList([ReversibleBlock() for _ in range(depth)])

    def forward(self, x):
        x = torch.cat([x, x], dim=-1)
        y1, y2 = _ReversibleFunction.apply(x, self.blocks).chunk(2, dim=-1)
        return y1 + y2


model = model_of(VOCAB, D, ReversibleStack)
batch = token_batch(VOCAB, BATCH, SEQ, 1800)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
