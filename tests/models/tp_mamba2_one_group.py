"""A Mamba-2 mixer with one group, written as the pure-PyTorch path of transformers' Mamba2, Bamba, Falcon-H1,
Granite-4 hybrid and Zamba2 writes it: one fused ``in_proj`` into the gate, x, B, C and dt (a per-feature muP
multiplier on its output, as Falcon-H1 has), a depthwise causal convolution over x, B and C together, the chunked
scan (B and C repeated to every head by ``repeat_interleave``, the chunk's scores an ``einsum`` over the state),
a gated RMSNorm over one group of every head's features (``view(b, s, 1, d)``) and ``out_proj``.

Under tensor parallelism each rank holds its heads of the gate, x and dt and its piece of B and C, which are
gathered: every head reads the one group's B and C whole.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, HEAD_DIM, STATE, KERNEL, CHUNK, BATCH, SEQ = 32, 32, 4, 16, 8, 4, 4, 4, 8
INNER = HEADS * HEAD_DIM


def segment_sum(x):
    """exp of this is the causal decay between positions of a chunk (-inf above the diagonal)."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~keep, 0)
    summed = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return summed.masked_fill(~keep, -torch.inf)


def chunk_scan(x, dt, A, B, C, D):
    b, s, h, p = x.shape
    groups = B.shape[2]
    B = B.repeat_interleave(h // groups, dim=2, output_size=h)
    C = C.repeat_interleave(h // groups, dim=2, output_size=h)
    residual = D[..., None] * x
    x = x * dt[..., None]
    A = A * dt
    x, A, B, C = [t.reshape(t.shape[0], -1, CHUNK, *t.shape[2:]) for t in (x, A, B, C)]
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    return (y_diag + y_off).reshape(b, s, h, p) + residual


class GatedNorm(nn.Module):
    def __init__(self, size, groups=1, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, x, gate):
        x = x * F.silu(gate)
        *prefix, last = x.shape
        grouped = x.view(*prefix, self.groups, last // self.groups)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(*prefix, last)


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_dim = INNER + 2 * STATE
        self.in_proj = nn.Linear(D, 2 * INNER + 2 * STATE + HEADS, bias=False)
        self.register_buffer("mup_vector", torch.linspace(0.5, 1.5, 2 * INNER + 2 * STATE + HEADS))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, KERNEL, groups=self.conv_dim, padding=KERNEL - 1)
        self.dt_bias = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, HEADS + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(HEADS))
        self.norm = GatedNorm(INNER)
        self.out_proj = nn.Linear(INNER, D, bias=False)

    def forward(self, hidden):
        b, s, _ = hidden.shape
        projected = self.in_proj(hidden) * self.mup_vector
        gate, xBC, dt = projected.split([INNER, self.conv_dim, HEADS], dim=-1)
        xBC = F.silu(self.conv1d(xBC.transpose(1, 2))[..., :s].transpose(1, 2))
        x, B, C = torch.split(xBC, [INNER, STATE, STATE], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        A = -torch.exp(self.A_log.float())
        y = chunk_scan(x.view(b, s, HEADS, HEAD_DIM), dt, A, B.view(b, s, 1, STATE), C.view(b, s, 1, STATE), self.D)
        return self.out_proj(self.norm(y.reshape(b, s, INNER), gate))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.mixer = Mixer()

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(2300 + step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
