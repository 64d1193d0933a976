"""A decoder with a factorized embedding, as ALBERT and RemBERT write theirs: tokens embedded in 16 features, then a
linear maps them to the hidden size 64 (``embedding_hidden_mapping_in``). Column-wise, that mapping's sharded output
would be read by the first layer's q, k and v (each then row-wise, three all-reduces where Megatron's plan has
one) and by the residual stream; computed whole on every rank (1,088 parameters, FLOPs every rank repeats), the
first layer is Megatron's plan (``split/tp_settle._spread_whole_where_cheaper``)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, E, D, HEADS, FF, LAYERS, BATCH, SEQ = 512, 16, 64, 4, 256, 2, 4, 8
HEAD = D // HEADS


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(D, D, bias=False)
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, HEADS, HEAD).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = self.norm1(x + self.o_proj(y.transpose(1, 2).reshape(b, s, D)))  # post-norm, as BERT's family does
        return self.norm2(x + self.down(F.gelu(self.up(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, E)
        self.embedding_hidden_mapping_in = nn.Linear(E, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embedding_hidden_mapping_in(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def model():
    torch.manual_seed(0)
    return LM()


def batch(step):
    g = torch.Generator().manual_seed(1300 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return (ids[:, :-1],), {}, ids[:, 1:]


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
