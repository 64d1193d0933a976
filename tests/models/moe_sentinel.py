"""A tiny mixture-of-experts LM whose experts mask the rows routed to no expert between their grouped matmuls, as
some transformers releases do (``proj_out.masked_fill(expert_ids >= num_experts, 0)``; transformers 5.17 does
it whether or not its own expert parallelism is on): 8 experts, top 2, transformers' ``grouped_mm_fallback``.
Expert parallelism must see the mask as a no-op on the rows it dispatches (every one of them is routed)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)

VOCAB, D, HIDDEN, EXPERTS, TOP_K, LAYERS, BATCH, SEQ = 32, 16, 24, 8, 2, 2, 4, 8


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, D) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, D, HIDDEN) * 0.1)

    def forward(self, x, ids, weights):
        expert_ids, perm = torch.sort(ids.reshape(-1))
        rows = x[perm // TOP_K]
        sentinel = (expert_ids >= EXPERTS).unsqueeze(-1)
        counts = torch.histc(expert_ids.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(rows, self.gate_up_proj.transpose(-2, -1), offsets)
        h = h.masked_fill(sentinel, 0.0)
        gate, up = h.chunk(2, dim=-1)
        out = torch.ops.transformers.grouped_mm_fallback(F.silu(gate) * up, self.down_proj.transpose(-2, -1),
                                                          offsets)
        out = out.masked_fill(sentinel, 0.0) * weights.reshape(-1)[perm].unsqueeze(-1)
        unsorted = torch.empty_like(out)
        unsorted[perm] = out
        return unsorted.view(-1, TOP_K, D).sum(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x):
        b, s, d = x.shape
        flat = self.norm(x).reshape(-1, d)
        weights, ids = torch.topk(F.softmax(self.router(flat), dim=-1), TOP_K)
        return x + self.experts(flat, ids, weights / weights.sum(-1, keepdim=True)).view(b, s, d)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return Net()


def _data(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def example_inputs():
    return (_data(0)[0],)


def example_target():
    return _data(0)[1]


def batch(step):
    idx, target = _data(step)
    return (idx,), {}, target


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = ["layers.1"]
