"""A decoder that applies its first block twice (weights shared across depth, as ALBERT, the Universal Transformer
and HRM apply a layer several times a step), then its second block once. Each call of a block runs its attention
and MLP, so Megatron's plan for it moves its bytes once per call: ``split/plan_cost.layer_bytes`` counts the calls
export records (``layers.0`` and ``layers.0@1`` on the module stack)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, FF, BATCH, SEQ = 48, 32, 4, 64, 4, 8
HEAD = D // HEADS


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, s, HEADS, HEAD).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in (self.layers[0], self.layers[0], self.layers[1]):
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (ids[:, :-1],), {}, ids[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
