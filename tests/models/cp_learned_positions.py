"""Learned positions looked up as nanoGPT looks them up (``model.py``, ``GPT.forward``: ``pos = torch.arange(0, t,
dtype=torch.long, device=device)``, then ``transformer.wpe(pos)``): ``arange`` with a start and a dtype, an
``aten.arange.start`` in the graph; GPT-2's block otherwise (one fused ``c_attn``, heads viewed as ``C //
n_head``, ``scaled_dot_product_attention`` with ``is_causal``, LayerNorm, a GELU MLP, the head tied to the token
embedding); 2 layers, hidden 64, 4 heads, 16 tokens.

``--cp 2`` must make the positions for this rank's part of the sequence (it crashed: ``TypeError: 'int' object is
not iterable``, the cut of the ``arange`` moved up to it read its start as a list of sizes).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib_style import D, FFN, HEADS, SEQ, VOCAB, loss_fn, sgd, token_batch


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)
        self.n_head = HEADS

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(D, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(D, FFN)
        self.c_proj = nn.Linear(FFN, D)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(D), CausalSelfAttention(), nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, D),
            wpe=nn.Embedding(SEQ, D),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(D)))
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT's

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = tok_emb + pos_emb
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def model():
    torch.manual_seed(0)
    return GPT()


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
