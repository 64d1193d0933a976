"""A tiny hybrid LM whose mixer is a selective state-space scan written as a Python loop over positions, as
transformers' Mamba writes its slow path (``modeling_mamba.py`` ``slow_forward``: ``for i in range(seq_len):
ssm_state = discrete_A[:, :, i] * ssm_state + deltaB_u[:, :, i]``, then ``torch.stack`` of the outputs), after a
causal attention layer, and a short convolution written as recurrentgemma's Griffin writes it (``layers.py``
``Conv1D``: a loop over shifts, each window a slice of the sequence masked in place, ``x_window *= mask``). The trace
unrolls the scan into one ``select`` of each position per step: under ``--cp`` each rank runs its own positions'
steps, the state entering its chunks carried from the chunks before (``split/cp_loop.py``); the shifted windows
(slices of the sequence: written into in place, they are slices of the gathered value) run on the whole sequence at
every cp rank, and the attention on each rank's positions.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, STATE, HEADS, BATCH, SEQ = 32, 16, 4, 2, 4, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, D))


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.in_proj = nn.Linear(D, 2 * D)
        self.x_proj = nn.Linear(D, 2 * STATE + 1)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, STATE + 1, dtype=torch.float32)).repeat(D, 1))
        self.D = nn.Parameter(torch.ones(D))
        self.out_proj = nn.Linear(D, D)

    def forward(self, x):
        b, s, _ = x.shape
        u, z = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        u = F.silu(u)
        B, C, dt = self.x_proj(u).split([STATE, STATE, 1], dim=-1)
        dt = F.softplus(dt)                                         # [b, s, 1]
        discrete_A = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.A_log))  # [b, s, D, STATE]
        deltaB_u = (dt * u).unsqueeze(-1) * B.unsqueeze(2)          # [b, s, D, STATE]
        state = torch.zeros(b, D, STATE, dtype=x.dtype, device=x.device)
        outputs = []
        for i in range(s):
            state = discrete_A[:, i] * state + deltaB_u[:, i]
            outputs.append(torch.matmul(state, C[:, i].unsqueeze(-1)).squeeze(-1))
        y = torch.stack(outputs, dim=1) + u * self.D
        return x + self.out_proj(y * F.silu(z))


class ShiftConv(nn.Module):
    """Griffin's temporal convolution of width 2 in training: each window the positions ``shift`` back, masked in
    place (its document mask: all ones here) and padded back to the sequence."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(2, D) / 2)
        self.register_buffer("mask", torch.ones(2, 1, 1, 1))

    def forward(self, x):
        s = x.shape[1]
        h = self.proj(x)
        out = 0.0
        for shift in range(2):
            window = h[:, : s - shift]
            window *= self.mask[shift]
            out = out + F.pad(window, (0, 0, shift, 0)) * self.w[shift]
        return x + out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Attention(), Mixer(), ShiftConv(), Attention(), Mixer()])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Model()


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return (_data(0)[0],)


def example_target():
    return _data(0)[1]


def batch(step):
    ids, target = _data(step)
    return (ids,), {}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
