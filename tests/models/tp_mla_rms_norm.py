"""Multi-head latent attention as torchtitan's DeepSeek-V3 writes it (``torchtitan/models/deepseek_v3/model.py``,
``Attention`` without a query low-rank pair, its ``debugmodel``): ``wq`` to each head's no-rotary and rotary
features, ``wkv_a`` down to a key/value latent and one rotary key shared by the heads (``split``), the latent
normalised by ``kv_norm``, an ``nn.RMSNorm`` (``F.rms_norm``: one op, no partial sums to read), ``wkv_b`` up to
each head's key and value, the shared rotary key ``expand``ed to the heads and ``cat`` after each head's own,
SDPA, ``wo``; RMSNorm pre-norms, a SwiGLU MLP. 2 layers, hidden 64, 4 heads (16 + 8 query/key, 16 value), a latent
of 32, 8 tokens.

Under ``--tp 2`` the latent is needed whole by ``kv_norm``: ``wkv_a`` is column-wise with its 40 output features
all-gathered (a low-rank pair gathered, as the transformers DeepSeek-V3's ``kv_a_proj_with_mqa``), ``wkv_b``
column-wise on the heads, ``wo`` row-wise. It was whole (torchtitan and Megatron-Core replicate it).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HEADS, NOPE, ROPE, V, LATENT, FFN, BATCH, SEQ = 128, 64, 4, 16, 8, 16, 32, 128, 4, 8


def rotary(x, cos, sin):  # x [b, s, heads, ROPE]
    x1, x2 = x[..., : ROPE // 2], x[..., ROPE // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(D, HEADS * (NOPE + ROPE), bias=False)
        self.wkv_a = nn.Linear(D, LATENT + ROPE, bias=False)
        self.kv_norm = nn.RMSNorm(LATENT, eps=1e-6)
        self.wkv_b = nn.Linear(LATENT, HEADS * (NOPE + V), bias=False)
        self.wo = nn.Linear(HEADS * V, D, bias=False)

    def forward(self, x, cos, sin):
        bsz, seqlen, _ = x.size()
        q = self.wq(x).view(bsz, seqlen, -1, NOPE + ROPE)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [LATENT, ROPE], dim=-1)
        q_pe, k_pe = rotary(q_pe, cos, sin), rotary(k_pe.unsqueeze(2), cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, NOPE + V)
        k_nope, v = torch.split(kv, [NOPE, V], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(D, FFN, bias=False), nn.Linear(FFN, D, bias=False), nn.Linear(D, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(D, eps=1e-6), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(D, eps=1e-6), FeedForward()

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm, self.output = nn.RMSNorm(D, eps=1e-6), nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        seqlen = tokens.shape[1]
        theta = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2).float() / ROPE))
        angles = torch.outer(torch.arange(seqlen).float(), theta).repeat(1, 2)[:, None, :]  # [s, 1, ROPE]
        cos, sin = angles.cos(), angles.sin()
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def model():
    torch.manual_seed(0)
    return Decoder()


def batch(step):
    g = torch.Generator().manual_seed(1700 + step)
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
