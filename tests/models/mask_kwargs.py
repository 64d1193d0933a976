"""Keyword inputs of every kind, read on every stage: a bool mask, int64 position ids, a None, a Python scalar.

``forward(idx, *, mask, position_ids, extra=None, scale=...)``: every layer reads the boolean ``mask`` (a
masked mean over the sequence) and the integer ``position_ids`` (its own position embedding), so each stage
reads them from its own copy of the batch. ``position_ids`` has batch dim 1 (broadcast, not chunked). The
output is a tuple ``(logits, {"hidden_rms": ...})`` that ``loss_fn`` unpacks, and the target is a dict.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, BATCH, SEQ = 24, 12, 4, 8, 6
SCALE = 0.5


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.pos = nn.Embedding(SEQ + 2, D)
        self.fc = nn.Linear(D, D)
        self.mix = nn.Linear(D, D, bias=False)

    def forward(self, x, mask, position_ids):
        keep = mask.unsqueeze(-1).to(x.dtype)
        h = torch.tanh(self.fc(self.norm(x) + self.pos(position_ids)))
        context = (h * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1.0)
        return x + torch.where(mask.unsqueeze(-1), h + self.mix(context), torch.zeros_like(h))


class MaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, *, mask, position_ids, extra=None, scale=1.0):
        x = self.embed(idx) * scale
        if extra is not None:
            x = x + extra
        for layer in self.layers:
            x = layer(x, mask, position_ids)
        return self.head(x), {"hidden_rms": x.pow(2).mean(-1)}


def model():
    torch.manual_seed(0)
    return MaskedLM()


def _data(step):
    g = torch.Generator().manual_seed(300 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.rand(BATCH, SEQ, generator=g) > 0.3
    mask[:, 0] = True  # every row keeps at least one position
    position_ids = (torch.arange(SEQ) + step % 3).unsqueeze(0)  # shape (1, SEQ): broadcast over the batch
    target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    kwargs = {"mask": mask, "position_ids": position_ids, "extra": None, "scale": SCALE}
    return (idx,), kwargs, {"tokens": target, "mask": mask}


def example_inputs():
    return _data(0)[0]


def example_kwargs():
    return _data(0)[1]


def example_target():
    return _data(0)[2]


def batch(step):
    return _data(step)


def loss_fn(output, target):
    logits, aux = output
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), target["tokens"].reshape(-1), reduction="none")
    keep = target["mask"].reshape(per_token.shape).to(per_token.dtype)
    # a mean over samples (each sample's masked token loss / SEQ), so microbatch weighting is exact
    per_sample = (per_token * keep).reshape(-1, SEQ).sum(1) / SEQ
    return per_sample.mean() + 0.01 * aux["hidden_rms"].mean()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


split_points = ["layers.2"]
