"""``nn.MultiheadAttention`` given its query, key and value as three tensors of equal values, as SpeechBrain's
``speechbrain.nnet.attention.MultiheadAttention`` passes them (it permutes each of the three to ``[seq, batch, d]``
on its own): torch's ``_in_projection_packed`` then takes its third path, ``in_proj_weight.chunk(3)`` and three
linears, where one tensor passed three times takes one linear of the packed weight. ``--tp 2`` crashed in the rewrite
(``KeyError: p_layers_0_in_proj_weight``). Pre-norm residual layers, a causal mask; hidden 64, 4 heads, 2 layers,
16 tokens, a batch of 4.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, SEQ, BATCH = 128, 64, 4, 16, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.layers = nn.ModuleList(nn.MultiheadAttention(D, HEADS) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)  # [batch, seq, d]
        n = ids.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), 1)
        for norm, attention in zip(self.norms, self.layers):
            x = norm(h)
            q, k, v = x.permute(1, 0, 2), x.permute(1, 0, 2), x.permute(1, 0, 2)  # SpeechBrain's three permutes
            out, _weights = attention(q, k, v, attn_mask=mask, need_weights=False)
            h = h + out.permute(1, 0, 2)
        return self.head(h)


def model():
    torch.manual_seed(0)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (tokens[:, :-1],), {}, tokens[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
