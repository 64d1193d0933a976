"""A tiny causal LM whose one layer mixes positions in a way no context-parallel rule spreads: by default run on the
whole sequence at every cp rank (named at split), refused by name under ``--verify strict``.

``CP_REFUSE`` picks what the layer does besides causal attention:

* ``cumprod``: a running product along the sequence (spread now, as running sums are: each chunk's own times the
  chunks' before it, ``cp_cumprod``);
* ``conv``: a centred 1-D convolution along the sequence (each position reads its neighbours on both sides; a causal
  one is spread: ``cp_causal_conv.py``);
* ``gather``: the hidden states read at positions given by an index (a gather of positions);
* ``chunkpad``: the sequence padded at its end to a multiple of a chunk, as a chunked scan pads it;
* ``mask``: attention with a ``[batch, 1, seq, seq]`` additive mask passed in by the caller (an input of the
  model, which the split cannot cut: the model should build it inside ``forward`` or use ``is_causal``);
* ``custom``: a running mean along the sequence written as a custom op (``torch.library``, as torchtitan writes its
  MoE's scatter-add): its code is its own, so context parallelism names it as a custom op;
* ``written``: RWKV's CPU path (``modeling_rwkv.py`` ``rwkv_linear_attention_cpu``): ``output = zeros_like(x)``, then
  ``output[:, i] = state`` position by position in a loop (a write into a value cp would hold as a shard: it is made
  whole where it is created, so the writes land in it);
* ``none``: plain causal attention (context parallelism splits it).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, BATCH, SEQ = 32, 16, 4, 8
MODE = os.environ.get("CP_REFUSE", "none")


@torch.library.custom_op("tracepp_test::running_mean", mutates_args=())
def running_mean(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(dim=1) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)


@running_mean.register_fake
def _(x):
    return torch.empty_like(x)


def _running_mean_backward(ctx, grad):  # d(mean of x[:t]) / d x[s] = 1/t for every t >= s
    counts = torch.arange(1, grad.shape[1] + 1, device=grad.device, dtype=grad.dtype).unsqueeze(-1)
    return (grad / counts).flip(1).cumsum(1).flip(1)


running_mean.register_autograd(_running_mean_backward)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, mask=None):
        x = self.embed(idx)
        if MODE == "cumprod":
            x = x.sigmoid().cumprod(dim=1)
        elif MODE == "conv":
            x = self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
        elif MODE == "custom":
            x = running_mean(x)
        elif MODE == "gather":
            x = x[:, torch.arange(x.shape[1] - 1, -1, -1, device=x.device)]
        elif MODE == "written":
            out, state = torch.zeros_like(x), torch.zeros_like(x[:, 0])
            for i in range(x.shape[1]):
                state = 0.5 * state + x[:, i]
                out[:, i] = state
            x = out
        elif MODE == "chunkpad":  # a chunked scan's padding to a multiple of its chunk (Mamba-2's pad_tensor_by_size)
            x = F.pad(x, (0, 0, 0, 3)).cumsum(1)[:, :SEQ]
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if MODE == "mask":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.squeeze(1))


def model():
    torch.manual_seed(0)
    return Model()


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    idx = _data(0)[0]
    if MODE == "mask":
        causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        return idx, causal.expand(BATCH, 1, SEQ, SEQ).contiguous()
    return (idx,)


def example_target():
    return _data(0)[1]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
